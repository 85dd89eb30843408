"""The interactive loop behind local_chat.py: read a prompt, stream the answer, keep history."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ktlong.config import Config
from ktlong.errors import KtlongError
from ktlong.chat.conversation import Conversation, PromptTooLongError
from ktlong.session.chunked import dense_session
from ktlong.session.protocol import Session
from ktlong.chat.generate import generate
from ktlong.models.loader import LoadedModel
from ktlong.chat.sampling import Sampler
from ktlong.chat.text_file import max_text_bytes, read_text_file

HELP = ('Type a message. Empty line: send the prompt file. A file path: send that file. """: start '
        'or end multi-line input. /reset: forget the conversation. /save PATH, /load PATH: the KV cache '
        'and conversation to a file and back (long-context mode). /exit: quit. Ctrl-C: stop an answer.')


class ChatLoop:
    def __init__(self, lm: LoadedModel, config: Config, max_seq_len: int, prompt_file: str | None,
                 out=None, err=None, session: Session | None = None, save_kv: str | None = None,
                 load_kv: str | None = None):
        self.lm, self.config, self.max_seq_len = lm, config, max_seq_len
        self.prompt_file, self.save_kv, self.load_kv = prompt_file, save_kv, load_kv
        self.failed: list[str] = []  # what the command line asked for and could not be done
        self.out, self.err = out or sys.stdout, err or sys.stderr
        template = lm.chat_template if config.use_chat_template else None
        self.conversation = Conversation(lm.tokenizer, template, config.system_prompt)
        self.session = session or dense_session(lm.model, config, max_seq_len)
        self.sampler = Sampler(config.temperature, config.top_p, config.top_k, config.seed)

    def notice(self, text: str):
        print(f"[{text}]", file=self.err, flush=True)

    def ask(self, user_text: str):
        reserve = min(self.config.max_new_tokens, self.max_seq_len // 2)
        try:
            ids, dropped = self.conversation.prompt_ids(user_text, self.max_seq_len, reserve)
        except PromptTooLongError as e:
            self.notice(str(e))
            return None
        if dropped:
            self.notice(f"dropped the {dropped} oldest turn(s) to stay within max_seq_len={self.max_seq_len}")
        result = generate(self.session, ids, self.config.max_new_tokens, self.sampler,
                          self.lm.tokenizer.stop_ids, self.lm.tokenizer,
                          on_text=lambda s: print(s, end="", file=self.out, flush=True),
                          show_progress=True)
        print(file=self.out, flush=True)
        self.conversation.add_turn(user_text, result.text)
        reused = result.prompt_tokens - self.session.last_prefill_tokens
        prefilled = f" ({reused} from the cache, {self.session.last_prefill_tokens} prefilled)" if reused else ""
        self.notice(f"{result.prompt_tokens} prompt tokens{prefilled} in {result.prefill_seconds:.2f}s, "
                    f"{len(result.token_ids)} tokens at {result.decode_tokens_per_second:.1f} tok/s"
                    + (", interrupted" if result.finish_reason == "interrupted" else ""))
        if self.save_kv and not self.save(self.save_kv):
            self.failed.append(f"--save_kv {self.save_kv}")
        return result

    def read_file(self, path: str) -> str | None:
        """A file's text as a message (read_text_file), or None after a notice of why not: the
        chat goes on."""
        try:
            return read_text_file(path, "file", max_text_bytes(self.max_seq_len))
        except KtlongError as e:
            self.notice(str(e))
            return None

    def next_prompt(self, read_line) -> str | None:
        """The next message, or None at end of input; handles files, multi-line and commands."""
        while True:
            line = read_line()
            if line is None:
                return None
            stripped = line.strip()
            if stripped == '"""':
                lines = []
                while (more := read_line()) is not None and more.strip() != '"""':
                    lines.append(more)
                return "\n".join(lines)
            if stripped == "":
                if self.prompt_file:
                    return self.read_file(self.prompt_file) or ""
                continue
            if stripped in ("/exit", "/quit"):
                return None
            if stripped == "/reset":
                self.conversation.reset()
                self.session.reset()
                self.notice("conversation cleared")
                continue
            command, _, argument = stripped.partition(" ")
            if command in ("/save", "/load"):
                if not argument.strip():
                    self.notice(f"{command} needs a file path, e.g. {command} doc.kv")
                else:
                    (self.save if command == "/save" else self.load)(argument.strip())
                continue
            if stripped in ("/help", "/?"):
                self.notice(HELP)
                continue
            if len(stripped) < 4096 and Path(stripped).expanduser().is_file():
                return self.read_file(stripped) or ""
            return line

    def _cache_needs(self) -> str:
        return "--mode long_context" if self.config.mode != "long_context" else "--tensor_parallel 1"

    def save(self, path: str) -> bool:
        """The KV cache and the conversation to a file (ktlong/session/saved_cache.py); False
        after a notice of why not."""
        from ktlong.session.saved_cache import fingerprint, save_cache

        if not self.session.saves_cache:
            self.notice(f"saving the KV cache needs {self._cache_needs()}")
            return False
        try:
            start = time.perf_counter()
            nbytes = save_cache(path, self.session, fingerprint(self.lm.path, self.session, self.config),
                                self.conversation.turns)
            how = "appended the new blocks" if self.session.saved_file.appended else "wrote the whole file"
            self.notice(f"saved {self.session.host.num_tokens:,} tokens of KV cache to {path} "
                        f"({how}: {nbytes / 2**20:,.1f} MiB in {time.perf_counter() - start:.1f}s)")
            return True
        except (KtlongError, OSError) as e:
            self.notice(f"not saved: {e}")
            return False
        except KeyboardInterrupt:  # the file is as the last save left it (a whole save renames at its end)
            self.notice(f"not saved: interrupted; {path} is as the last save left it")
            return False

    def load(self, path: str) -> bool:
        """A saved cache and its conversation; the chat goes on from there. False after a notice
        of why not."""
        from ktlong.session.saved_cache import fingerprint, load_cache

        if not self.session.saves_cache:
            self.notice(f"loading a KV cache needs {self._cache_needs()}")
            return False
        try:
            start = time.perf_counter()
            turns = load_cache(path, self.session, fingerprint(self.lm.path, self.session, self.config))
        except (KtlongError, OSError) as e:
            self.notice(f"not loaded: {e}")
            return False
        self.conversation.turns = list(turns)
        self.notice(f"loaded {self.session.host.num_tokens:,} tokens of KV cache and {len(turns)} turn(s) "
                    f"from {path} in {time.perf_counter() - start:.1f}s")
        return True

    def run(self, interactive: bool, wrap_reader=None) -> list[str]:
        """Chat until the input ends; returns what it was asked to do and could not (a --load_kv
        that failed: then a piped run answers nothing; a --save_kv that failed), each already
        noticed. wrap_reader: turns the input line reader into another (tensor parallelism: rank
        0 reads and broadcasts, ktlong/parallel/group.py)."""
        if self.load_kv and not self.load(self.load_kv):
            self.failed.append(f"--load_kv {self.load_kv}")
            if not interactive:  # answering without the document would mislead
                return self.failed
        if interactive:
            self.notice(HELP)
        if self.prompt_file:
            text = self.read_file(self.prompt_file)
            if text:
                self.ask(text)

        def read_line():
            while True:
                try:
                    line = input("> " if interactive else "")
                    line.encode("utf-8")  # undecodable bytes arrive as lone surrogates or fail here
                    return line
                except EOFError:
                    return None
                except (UnicodeDecodeError, UnicodeEncodeError):
                    raise KtlongError("Standard input is not UTF-8 text; convert it first (iconv -t UTF-8).") from None
                except KeyboardInterrupt:
                    print(file=self.out)
                    self.notice("use /exit to quit")

        if wrap_reader is not None:
            read_line = wrap_reader(read_line)
        while (text := self.next_prompt(read_line)) is not None:
            if text.strip():
                self.ask(text)
        return self.failed
