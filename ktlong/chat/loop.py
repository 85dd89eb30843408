"""The interactive loop behind local_chat.py: read a prompt, stream the answer, keep history."""

from __future__ import annotations

import hashlib
import os
import sys
import time

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
                 load_kv: str | None = None, tp=None):
        """tp: the tensor-parallel group this rank chats in (every rank runs the same loop; a
        saved cache is a file a rank, written and read alike on all of them), or None."""
        self.lm, self.config, self.max_seq_len, self.tp = lm, config, max_seq_len, tp
        self.prompt_file, self.save_kv, self.load_kv = prompt_file, save_kv, load_kv
        self.failed: list[str] = []  # what the command line asked for and could not be done
        self.refused = 0  # messages and commands that could not be sent or done, each noticed
        self.out, self.err = out or sys.stdout, err or sys.stderr
        template = lm.chat_template if config.use_chat_template else None
        self.conversation = Conversation(lm.tokenizer, template, config.system_prompt)
        self.session = session or dense_session(lm.model, config, max_seq_len)
        self.sampler = Sampler(config.temperature, config.top_p, config.top_k, config.seed, config.presence_penalty,
                               config.frequency_penalty)

    def notice(self, text: str):
        print(f"[{text}]", file=self.err, flush=True)

    def refuse(self, text: str):
        """A notice that a message or command could not be sent or done: the chat goes on, and a
        piped run that refused any exits non-zero."""
        self.refused += 1
        self.notice(text)

    def ask(self, user_text: str):
        reserve = min(self.config.max_new_tokens, self.max_seq_len // 2)
        try:
            ids, dropped = self.conversation.prompt_ids(user_text, self.max_seq_len, reserve)
        except PromptTooLongError as e:
            self.refuse(str(e))
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
                    + (", interrupted" if result.finish_reason == "interrupted" else "")
                    + (f", stopped at max_seq_len {self.max_seq_len:,}" if result.finish_reason == "length"
                       and len(result.token_ids) < self.config.max_new_tokens else ""))
        if self.save_kv and not self.save(self.save_kv):
            self.failed.append(f"--save_kv {self.save_kv}")
        return result

    def read_file(self, path: str) -> str | None:
        """A file's text as a message (read_text_file), or None after a notice of why not: the
        chat goes on."""
        try:
            return read_text_file(path, "file", max_text_bytes(self.max_seq_len))
        except KtlongError as e:
            self.refuse(str(e))
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
                    self.refuse(f"{command} needs a file path, e.g. {command} doc.kv")
                elif not (self.save if command == "/save" else self.load)(argument.strip()):
                    self.refused += 1
                continue
            if stripped in ("/help", "/?"):
                self.notice(HELP)
                continue
            if len(stripped) < 4096 and os.path.isfile(os.path.expanduser(stripped)):  # never raises: a
                # long message is too long a name, "~word ..." names no user
                return self.read_file(stripped) or ""
            return line

    def _alike(self, reason: str, values: list[int], differ: str) -> str:
        """Without tensor parallelism: reason. Under it: what every rank did, said alike on
        each (TensorParallel.alike)."""
        return reason if self.tp is None else self.tp.alike(reason, values, differ)

    def save(self, path: str) -> bool:
        """The KV cache and the conversation to a file (ktlong/session/saved_cache.py; under
        tensor parallelism each rank's part to a file of its own); False after a notice of why
        not."""
        from ktlong.session.saved_cache import fingerprint, rank_path, save_cache

        if not self.session.saves_cache:
            self.notice("saving the KV cache needs --mode long_context")
            return False
        try:
            target = rank_path(path, self.tp)
        except KtlongError as e:  # a path no file system takes
            self.notice(f"not saved: {e}")
            return False
        reason, nbytes = "", 0
        start = time.perf_counter()
        try:
            nbytes = save_cache(target, self.session, fingerprint(self.lm.path, self.session, self.config),
                                self.conversation.turns)
        except (KtlongError, OSError) as e:
            reason = str(e)
        except KeyboardInterrupt:  # the file is as the last save left it (a whole save renames at its end)
            reason = f"interrupted; {target} is as the last save left it"
        reason = self._alike(reason, [], "")
        if reason:
            self.notice(f"not saved: {reason}")
            return False
        how = "appended the new blocks" if self.session.saved_file.appended else "wrote the whole file"
        parts = f", a part a rank ({target.name} here)" if self.tp is not None else ""
        self.notice(f"saved {self.session.host.num_tokens:,} tokens of KV cache to {path}{parts} "
                    f"({how}: {nbytes / 2**20:,.1f} MiB in {time.perf_counter() - start:.1f}s)")
        return True

    def load(self, path: str) -> bool:
        """A saved cache and its conversation; the chat goes on from there. False after a notice
        of why not. Under tensor parallelism every rank reads its own part, and the parts are
        taken only if they hold the same tokens: the ranks check their parts' headers first (a
        refusal leaves every rank as it was), then fill, and if any rank's data fails its checks,
        every rank's cache is emptied, as one process's would be."""
        from ktlong.session.saved_cache import fingerprint, load_cache, rank_path, saved_as, saved_token_ids

        if not self.session.saves_cache:
            self.notice("loading a KV cache needs --mode long_context")
            return False
        try:
            target = rank_path(path, self.tp)
        except KtlongError as e:  # a path no file system takes
            self.notice(f"not loaded: {e}")
            return False
        fp = fingerprint(self.lm.path, self.session, self.config)
        start, reason, turns = time.perf_counter(), "", []

        def why(e: Exception) -> str:  # a file saved for another count of ranks is named as such
            hint = saved_as(path, self.tp)
            return str(e).removesuffix("; check the path.") + hint if hint else str(e)

        if self.tp is not None:  # the headers first
            ids = []
            try:
                ids = saved_token_ids(target, fp, self.session.max_seq_len)
            except (KtlongError, OSError) as e:
                reason = why(e)
            digest = int.from_bytes(hashlib.sha256(repr(ids).encode()).digest()[:7], "big")
            reason = self._alike(reason, [len(ids), digest], f"the ranks' parts of {path} hold different tokens "
                                 "(from different chats, or one older than the others); save it again")
        if not reason:
            try:
                turns = load_cache(target, self.session, fp)
            except (KtlongError, OSError) as e:
                reason = why(e)
            reason = self._alike(reason, [self.session.host.num_tokens], f"the ranks' parts of {path} held "
                                 "different tokens once read")
            if reason and self.tp is not None:  # no rank keeps a part the others lack
                self.session.reset()
        if reason:
            self.notice(f"not loaded: {reason}")
            return False
        self.conversation.turns = list(turns)
        self.notice(f"loaded {self.session.host.num_tokens:,} tokens of KV cache and {len(turns)} turn(s) "
                    f"from {path} in {time.perf_counter() - start:.1f}s")
        return True

    def run(self, interactive: bool, wrap_reader=None) -> list[str]:
        """Chat until the input ends; returns what it was asked to do and could not (a --load_kv
        that failed: then a piped run answers nothing; a --prompt_file or --save_kv that failed;
        in a piped run, messages and commands of the input that were refused), each already
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
            if not (text and self.ask(text)):
                self.failed.append(f"--prompt_file {self.prompt_file}")
        before = self.refused

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
        if not interactive and self.refused > before:
            count = self.refused - before
            self.failed.append(f"{count} message{'s' if count > 1 else ''} or command{'s' if count > 1 else ''} "
                               "of the piped input")
        return self.failed
