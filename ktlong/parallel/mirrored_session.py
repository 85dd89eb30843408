"""The server under torchrun: rank 0 serves HTTP, and every rank runs each prefill and decode
step with it.

Each rank holds its share of the heads and its own DRAM cache, so every call that runs the model
must run on every rank, in the same order, with the same inputs (the ranks' all-reduces meet
inside it). Rank 0's worker (ktlong/server/worker.py) drives a MirroredSession: before each
prefill or step it broadcasts what it is about to run (JSON over gloo, no pickle), and the other
ranks, in `follow`, run the same call on their own session. A prefill asks whether to stop after
every chunk of every layer; rank 0's answer (a cancel, a disconnect, the server closing) is
broadcast there too, so every rank stops at the same chunk. Sampling, the grammar and the
stream's text stay on rank 0, which sends each chosen token with the step that feeds it.

What the ranks run is one conversation at a time: the cache store of many conversations
(conversations moving between DRAM caches, batches of several) is not mirrored, so the worker
decodes one answer at a time and a request that extends the last conversation reuses its cache.
"""

from __future__ import annotations

import json
import sys
from typing import Callable

import torch

from ktlong.errors import Cancelled


class MirroredSession:
    """Rank 0's session: what it runs, every other rank runs too (`follow`). Everything else is
    the wrapped session's."""

    def __init__(self, session, tp):
        self._session, self._tp = session, tp

    def __getattr__(self, name):
        return getattr(self._session, name)

    def _tell(self, command: dict):
        self._tp.broadcast_text(json.dumps(command))

    def prefill(self, prompt_ids: list[int], show_progress: bool = False,
                should_stop: Callable[[], bool] | None = None, on_progress=None, alone: bool = True,
                answer_room: int | None = None, short_launches: bool = False):
        self._tell({"op": "prefill", "ids": list(prompt_ids), "alone": alone, "answer_room": answer_room})

        def agreed() -> bool:  # asked after every chunk of every layer, on every rank alike
            return self._tp.broadcast_flag(bool(should_stop()) if should_stop is not None else False)

        # short_launches stays off: its pieces would ask `agreed` between them on this rank only
        # (and nothing prefills beside decode steps here: step_batch)
        return self._session.prefill(prompt_ids, show_progress, agreed, on_progress, alone, answer_room)

    def step(self, token_id: int) -> torch.Tensor:
        self._tell({"op": "step", "token": int(token_id)})
        return self._session.step(token_id)

    def step_batch(self, conversations: list, tokens: list[int], while_waiting=None):
        """One conversation, the session's own: its `step`, the call the other ranks make too
        (nothing prefills beside it here)."""
        assert len(conversations) == 1 and conversations[0] is self._session.conversation, \
            "under torchrun the ranks decode the session's own conversation only"
        return self.step(tokens[0])[None]

    def close(self):
        """The other ranks leave `follow` (where they are still there: a signal may have ended
        them already, torchrun passing it to every rank)."""
        try:
            self._tp.broadcast_text(None)
        except RuntimeError:  # gloo: the peer is gone
            pass


def follow(session, tp) -> int:
    """A rank other than 0: run what rank 0's MirroredSession sends until it closes. A call that
    fails fails on rank 0 too (the same inputs, the same state); it is reported here and the rank
    goes on with the next. Ctrl-C (which reaches every rank) ends it quietly."""
    try:
        _follow(session, tp)
    except KeyboardInterrupt:
        pass
    return 0


def _follow(session, tp):
    while (text := tp.broadcast_text("")) is not None:
        command = json.loads(text)
        try:
            if command["op"] == "prefill":
                session.prefill(command["ids"], False, lambda: tp.broadcast_flag(False), None, command["alone"],
                                command["answer_room"])
            elif command["op"] == "step":
                session.step(command["token"])
        except Cancelled:
            pass  # rank 0 stopped the prefill at the same chunk: the session reset itself alike
        except Exception as e:  # noqa: BLE001 - the worker on rank 0 answers the client
            print(f"[rank {tp.rank}: {command['op']} failed: {e}]", file=sys.stderr, flush=True)
