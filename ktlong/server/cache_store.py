"""The server's cache of many conversations, in DRAM and on disk.

The session works on one conversation (the live one). When a request starts another, the live
one is handed over whole (LongContextSession.exchange: its DRAM host cache changes owner, no
copy) and held in DRAM, up to cache_dram_gb of held caches; past that, the least recently used
one is spilled to a file in cache_dir (the saved-cache format of ktlong/session/saved_cache.py:
fingerprint, checksums, atomic whole writes, appends of what changed), up to cache_disk_gb of
files, the least recently used going first. A request whose prompt shares at least
cache_min_tokens leading tokens with a held or spilled conversation, more than with the live
one, gets that conversation back: from DRAM by a swap, from disk by a load. A restart finds the
files again (their headers checked against this session's fingerprint).

With several answers decoding at once (ktlong/server/worker.py), a conversation whose answer is
decoding leaves the session when the next prefill needs it (`detach`): it is held, and busy, so
that no other request takes it and no eviction spills it, until its answer ends (`release`).

A host cache holds DRAM only for the tokens it reserves (ktlong/kv/host_cache.py), so making one is
cheap and an empty one costs nothing. The idle caches (held conversations and spares) hold at
most cache_dram_gb; the ones at work (the session's and the busy ones) whatever their requests
need: `admit` lets a request start when its cache fits beside them within the DRAM the server may
use (dram_limit), dropping spares and spilling idle conversations to make room.

Every method that touches the session runs on the worker's thread; `lock` guards the index
for readers on the event loop (listing, metrics).
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ktlong.errors import ConfigError
from ktlong.kv.host_cache import HostKVCache, cache_bytes_for
from ktlong.kv.shared_prefix import dram_held
from ktlong.regular_file import user_path
from ktlong.session.cache_records import CacheFileError, OtherSettings
from ktlong.session.long_context import HeldConversation, LongContextSession
from ktlong.session.prefix import cached_prefix
from ktlong.session.saved_cache import load_cache, remove_orphans, save_cache, saved_token_ids

SUFFIX = ".ktkv"
ENTRY_ID = re.compile(r"[0-9a-f]{12}")


class Busy(CacheFileError):
    """The conversation (or the session) is answering a request now."""


@dataclass
class Entry:
    id: str
    ids: list[int]  # the tokens its cache holds (the live entry's: the session's, as last parked)
    last_used: float
    held: HeldConversation | None = None  # held in DRAM
    disk_bytes: int = 0  # its file's size; 0: not on disk
    disk_tokens: int = 0  # tokens its file holds
    # answering a request: in the session (`answering` .. `finished`) or out of it (`detach` .. `release`)
    busy: bool = False


def ready_folder(folder: Path) -> Path:
    """cache_dir, made where missing; ConfigError in one sentence where it cannot be a writable
    folder (a file there, no permission)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cache_dir {folder} cannot be a folder ({e.strerror or e}); name another.") from None
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"cache_dir {folder} is not writable; name another.")
    return folder


class CacheStore:
    def __init__(self, session: LongContextSession, fingerprint: dict, dram_bytes: int, folder: str,
                 disk_bytes: int, min_tokens: int, log, dram_limit: int = 1 << 62):
        """dram_bytes: cache_dram_gb, for the idle caches; dram_limit: the DRAM every cache
        together may hold (`admit`)."""
        self.session, self.fp, self.min_tokens, self.log = session, fingerprint, min_tokens, log
        self.budget, self.dram_limit = dram_bytes, dram_limit
        self.folder = user_path(folder) if folder else None
        self.disk_budget = disk_bytes
        self.entries: dict[str, Entry] = {}
        self.live: Entry | None = None  # the conversation the session holds
        self.spare: list[HostKVCache] = []  # free host caches (the memory they reserved kept for the next)
        self.lock = threading.Lock()
        if self.folder is not None:
            self._scan()

    def _new_host(self) -> HostKVCache:
        return HostKVCache(self.session.layout, pin=not self.session.host.maps_files)

    # ---- what the worker asks before and after a generation ----

    def prepare(self, prompt_ids: list[int]) -> str | None:
        """Make the session hold the conversation that shares the longest prefix with
        prompt_ids (its own, or one held or spilled); returns where the reused tokens come from
        (session, dram or disk), None for a new conversation. A conversation that is answering
        is not taken over, but a new one may share its leading blocks (LongContextSession.share:
        one copy in DRAM, the rest of their common prefix copied): "shared"."""
        with self.lock:
            session = self.session
            live = session.reusable(prompt_ids)
            keep = live > 0 and (not self._worth_keeping() or live >= len(session.ids) - 1
                                 or (live >= self.min_tokens and 2 * live >= len(session.ids)))
            best, best_n = None, 0  # the idle conversation to take over
            source, shared = None, 0  # the answering one to share blocks with
            for entry in self.entries.values():
                if entry is self.live:
                    continue
                if not entry.busy and (n := cached_prefix(entry.ids, prompt_ids)) > best_n:
                    best, best_n = entry, n
                if entry.busy and entry.held is not None and (n := session.shareable(entry.held, prompt_ids)) > shared:
                    source, shared = entry, n
            if shared >= self.min_tokens and shared > (live if keep else 0) and (
                    best_n < self.min_tokens or shared > best_n):
                self._park_live()
                self.live = Entry(self._new_id(), [], time.time())
                self.entries[self.live.id] = self.live
                session.share(source.held, prompt_ids)
                return "shared"
            if best is not None and best_n >= self.min_tokens and best_n > (live if keep else 0):
                where = "dram" if best.held is not None else "disk"
                if self._bring(best):
                    return where
            elif keep:
                self.live.last_used = time.time()
                return "session"
            self._park_live()
            self.live = Entry(self._new_id(), [], time.time())
            self.entries[self.live.id] = self.live
            return None

    def answering(self):
        """An answer decodes in the session's conversation: until it is done (`finished`) or it
        leaves (`detach`), no endpoint may restore another into the session or erase it."""
        with self.lock:
            if self.live is not None:
                self.live.busy = True

    def finished(self):
        """After a generation in the session: the live entry's tokens and time."""
        with self.lock:
            if self.live is not None:
                self.live.ids, self.live.last_used = list(self.session.ids), time.time()
                self.live.busy = False

    def detach(self) -> tuple[Entry | None, HeldConversation]:
        """The live conversation, decoding, leaves the session for the next prefill: held in
        DRAM and busy until `release`; the session goes on with a spare cache or a new one."""
        with self.lock:
            host = self._free_host()
            conversation = self.session.detach(host)
            entry, self.live = self.live, None
            if entry is not None:
                entry.ids, entry.held = list(conversation.ids), conversation
            return entry, conversation

    def release(self, entry: Entry | None, conversation: HeldConversation, keep: bool = True):
        """A detached conversation's answer is done: it stays held in DRAM like any kept one
        (its decoder too, while the device has room), within cache_dram_gb, the least recently
        used idle ones spilled to disk past it; forgotten when short or when not `keep` (its
        decode failed)."""
        with self.lock:
            if entry is None or self.entries.get(entry.id) is not entry:
                self.spare.append(conversation.host)
            else:
                entry.busy, entry.last_used = False, time.time()
                entry.ids = list(conversation.ids)
                if not keep or len(entry.ids) < self.min_tokens:
                    entry.held = None
                    self.spare.append(conversation.host)
                    if not keep:
                        self._remove_file(entry)
                    self._fall_back(entry)
                else:
                    self.session.park(conversation)
            self._trim(self.budget)

    def admit(self, prompt_ids: list[int], tokens: int, alone: bool) -> bool:
        """Whether a request of `tokens` (prompt and answer) may start: its cache and its
        prefill's hidden states fit beside the others within dram_limit, after dropping spares
        and spilling idle conversations (least recently used first; never one the prompt would
        reuse) as needed, which happens only when it makes room enough. The session's own
        conversation, idle and not reused, is such a one too: the new prompt would park it beside
        itself (a 1M prompt after another filled the machine's DRAM for want of this). Alone
        (nothing else running) it starts whatever: the plan checked that one conversation of
        max_seq_len fits."""
        # its cache, and while it prefills its hidden states (counted whole, whatever it reuses)
        need = cache_bytes_for(self.session.layout, tokens) + self.session.engine.dram_bytes(len(prompt_ids))
        with self.lock:
            reused = {e.id for e in self.entries.values() if cached_prefix(e.ids, prompt_ids) >= self.min_tokens}
            live_idle = self.live is not None and not self.live.busy and self.live.id not in reused
            freeable = (sum(h.dram_bytes for h in self.spare) + sum(e.held.host.dram_bytes for e in self._idle(reused))
                        + (self.session.host.dram_bytes if live_idle else 0))
            if not alone and self._held() - freeable + need > self.dram_limit:
                return False  # it waits; nothing idle is given up for room that would not be enough
            while self._held() + need > self.dram_limit:
                if not self._evict_one(reused):
                    if not live_idle or self.live is None:
                        break
                    self._park_live()  # held as an idle conversation, which the next turn evicts
            return True

    # ---- the operator's endpoints ----

    def listing(self) -> list[dict]:
        with self.lock:
            return [self._describe(e) for e in sorted(self.entries.values(), key=lambda e: -e.last_used)
                    if e is not self.live or self.session.ids]

    def save(self, entry_id: str) -> dict:
        """Write one conversation to its file now (an append when the file is the one it left)."""
        with self.lock:
            entry = self._entry(entry_id)
            if self.folder is None:
                raise CacheFileError("This server has no cache_dir; start it with --cache_dir FOLDER to save "
                                     "conversations to disk.")
            if entry.held is None and entry is not self.live:
                return self._describe(entry)  # only on disk: saved already
            if not self._spill(entry, self.session if entry is self.live else entry.held):
                raise CacheFileError(f"Could not save conversation {entry_id}; the server's log says why.")
            return self._describe(entry)

    def restore(self, entry_id: str) -> dict:
        """Make one conversation the session's (a request that extends it prefills only its new
        tokens)."""
        with self.lock:
            entry = self._entry(entry_id, idle=True)
            if entry is not self.live and self.live is not None and self.live.busy:
                raise Busy(f"The session is answering a request now; retry restoring {entry_id} when it is "
                           "done.")
            if entry is not self.live and not self._bring(entry):
                raise CacheFileError(f"Conversation {entry_id}'s file could not be loaded; the server's log says "
                                     "why.")
            return self._describe(entry)

    def erase(self, entry_id: str):
        """Forget one conversation: out of DRAM, its file removed."""
        with self.lock:
            entry = self._entry(entry_id, idle=True)
            if entry is self.live:
                self.session.reset()
                self.live = None
            elif entry.held is not None:
                self.spare.append(entry.held.host)
            self._remove_file(entry)
            del self.entries[entry.id]

    def close(self):
        """At shutdown: every conversation in DRAM written to its file (with a cache_dir)."""
        with self.lock:
            if self.folder is None:
                return
            for entry in list(self.entries.values()):
                if entry is self.live and self._worth_keeping():
                    entry.ids = list(self.session.ids)
                    self._spill(entry, self.session)
                elif entry.held is not None:
                    self._spill(entry, entry.held)

    def dram_bytes(self) -> int:
        """For /metrics, from the event loop: a copy of the index, which the worker may be
        changing. Blocks that several caches share count once."""
        return self._held()

    def _held(self) -> int:
        hosts = [self.session.host, *(e.held.host for e in list(self.entries.values()) if e.held is not None),
                 *self.spare]
        return dram_held(hosts)

    def disk_bytes(self) -> int:
        return sum(e.disk_bytes for e in list(self.entries.values()))

    # ---- moving conversations ----

    def _worth_keeping(self) -> bool:
        """Whether the live conversation is kept when another takes the session: long enough
        to be worth a restore."""
        return self.live is not None and len(self.session.ids) >= self.min_tokens

    def _bring(self, entry: Entry) -> bool:
        """entry becomes the session's conversation, the live one parked first; False (the
        entry dropped, the session empty) when its file cannot be loaded."""
        session = self.session
        if entry.held is not None:
            outgoing = session.exchange(entry.held)
            entry.held = None
            self._keep_outgoing(outgoing)
        else:
            self._park_live(keep=entry)
            start = time.perf_counter()
            try:
                load_cache(self._path(entry), session, self.fp)
            except (CacheFileError, OSError) as e:
                self.log(f"[cache: conversation {entry.id} dropped: {e}]")
                self._remove_file(entry)
                self.entries.pop(entry.id, None)
                session.reset()
                self.live = None
                return False
            entry.ids = list(session.ids)
            seconds = time.perf_counter() - start
            self.log(f"[cache: conversation {entry.id} loaded from disk: {len(entry.ids):,} tokens, "
                     f"{entry.disk_bytes / 2**30:.2f} GiB in {seconds:.2f} s ({entry.disk_bytes / 2**30 / seconds:.2f} GiB/s)]")
        self.live, entry.last_used = entry, time.time()
        return True

    def _keep_outgoing(self, outgoing: HeldConversation):
        """What a swap handed over: held when it was worth keeping, else its host cache freed."""
        live = self.live
        if live is not None and len(outgoing.ids) >= self.min_tokens:
            live.ids, live.held = list(outgoing.ids), outgoing
        else:
            self.spare.append(outgoing.host)
            if live is not None:
                self._fall_back(live)
        self.live = None

    def _park_live(self, keep: Entry | None = None):
        """The session emptied, its conversation held in DRAM (a slot freed by spilling the least
        recently used one to disk when all are taken), or spilled at once without slots, or
        forgotten when too short to keep. keep: the conversation about to be loaded, whose file
        no spill may remove to make room."""
        live, session = self.live, self.session
        if live is None or not self._worth_keeping():
            session.reset()
            if live is not None:
                self._fall_back(live)
            self.live = None
            return
        live.ids = list(session.ids)
        protect = {keep.id} if keep is not None else set()
        if not self._trim(self.budget - session.host.dram_bytes, protect, keep):  # too big to hold: straight to disk
            if not self._spill(live, session, keep):
                self.entries.pop(live.id, None)
            session.reset()
        else:
            live.held = session.exchange(HeldConversation.empty(session.layout, self._free_host()))
        self.live = None

    def _fall_back(self, entry: Entry):
        """A conversation the session dropped: what its file holds stays an entry."""
        if not entry.disk_bytes:
            self.entries.pop(entry.id, None)
            return
        try:
            entry.ids = saved_token_ids(self._path(entry), self.fp, self.session.max_seq_len)
        except (CacheFileError, OSError) as e:
            self.log(f"[cache: conversation {entry.id} dropped: {e}]")
            self._remove_file(entry)
            self.entries.pop(entry.id, None)

    def _free_host(self) -> HostKVCache:
        """A host cache for the session: a spare (the one holding the most memory), or a new one."""
        if self.spare:
            self.spare.sort(key=lambda h: h.dram_bytes)
            return self.spare.pop()
        return self._new_host()

    def _trim(self, budget: int, protect: set = frozenset(), keep: Entry | None = None) -> bool:
        """Idle caches down to `budget` bytes (`_evict_one` at a time); whether they fit it now."""
        while self._idle_bytes() > budget and self._evict_one(protect, keep):
            pass
        return self._idle_bytes() <= budget

    def _evict_one(self, protect: set = frozenset(), keep: Entry | None = None) -> bool:
        """A spare dropped (its memory freed), or else the least recently used idle conversation
        not in `protect` spilled to disk (forgotten without one); False when there is neither.
        keep: the conversation about to be loaded, whose file no spill may remove to make room."""
        if self.spare:
            self.spare.sort(key=lambda h: h.dram_bytes)
            self.spare.pop(0)
            return True
        if not (idle := self._idle(protect)):
            return False
        victim = min(idle, key=lambda e: e.last_used)
        if not self._spill(victim, victim.held, keep):
            self.entries.pop(victim.id, None)
        victim.held = None
        return True

    def _idle(self, protect: set = frozenset()) -> list[Entry]:
        return [e for e in self.entries.values() if e.held is not None and not e.busy and e.id not in protect]

    def _idle_bytes(self) -> int:
        return sum(e.held.host.dram_bytes for e in self._idle()) + sum(h.dram_bytes for h in self.spare)

    # ---- the disk tier ----

    def _spill(self, entry: Entry, source, keep: Entry | None = None) -> bool:
        """Write entry's cache (the session's or a held one) to its file; False when it could
        not be (no cache_dir, over the disk budget, a failed write: logged). keep: an entry
        whose file stays, whatever room the write needs."""
        if self.folder is None:
            return False
        try:
            save_cache(self._path(entry), source, self.fp, [],
                       make_room=lambda size, whole: self._make_room(size, whole, entry, keep))
        except (CacheFileError, OSError) as e:
            self.log(f"[cache: conversation {entry.id} not written to disk: {e}]")
            return False
        entry.disk_bytes, entry.disk_tokens = self._path(entry).stat().st_size, len(source.ids)
        return True

    def _make_room(self, size: int, whole: bool, writing: Entry, keep: Entry | None = None):
        """Remove the least recently used files (not keep's) until `size` bytes fit
        cache_disk_gb (a whole write replaces the entry's file; an append adds to it)."""
        while self.disk_bytes() - (writing.disk_bytes if whole else 0) + size > self.disk_budget:
            others = [e for e in self.entries.values() if e.disk_bytes and e is not writing and e is not keep]
            if not others:
                raise CacheFileError(f"it needs {size / 2**30:.2f} GiB and cache_disk_gb allows "
                                     f"{self.disk_budget / 2**30:.2f} GiB; raise cache_disk_gb")
            victim = min(others, key=lambda e: e.last_used)
            self._remove_file(victim)
            if victim.held is None and victim is not self.live:
                del self.entries[victim.id]

    def _remove_file(self, entry: Entry):
        if entry.disk_bytes:
            self._path(entry).unlink(missing_ok=True)
            entry.disk_bytes = entry.disk_tokens = 0
            if entry.held is not None:
                entry.held.saved_file = None
            elif entry is self.live:
                self.session.saved_file = None

    def _scan(self):
        """The files of an earlier run, their headers checked: a damaged one is removed (it
        would take disk space outside cache_disk_gb for ever), one made for other settings is
        left alone, as are files of other names. So are partial writes whose process is gone."""
        ready_folder(self.folder)
        for tmp in self.folder.glob(f".*{SUFFIX}.*.tmp"):
            remove_orphans(self.folder / tmp.name[1:tmp.name.index(SUFFIX) + len(SUFFIX)])
        for path in sorted(self.folder.glob("*" + SUFFIX)):
            if not ENTRY_ID.fullmatch(path.stem):
                continue
            if path.is_symlink() or not path.is_file() or not os.access(path, os.R_OK):
                self.log(f"[cache: {path.name} skipped: not a readable regular file]")
                continue
            try:
                ids = saved_token_ids(path, self.fp, self.session.max_seq_len)
                st = path.stat()
            except (OtherSettings, OSError) as e:
                self.log(f"[cache: {path.name} skipped: {e}]")
                continue
            except CacheFileError as e:
                path.unlink(missing_ok=True)
                self.log(f"[cache: {path.name} removed: {e}]")
                continue
            self.entries[path.stem] = Entry(path.stem, ids, st.st_mtime, disk_bytes=st.st_size,
                                            disk_tokens=len(ids))

    def _path(self, entry: Entry) -> Path:
        return self.folder / f"{entry.id}{SUFFIX}"

    def _new_id(self) -> str:
        while (new := secrets.token_hex(6)) in self.entries:
            pass
        return new

    def _entry(self, entry_id: str, idle: bool = False) -> Entry:
        """idle: the entry must not be answering a request now (restore, erase)."""
        entry = self.entries.get(entry_id) if ENTRY_ID.fullmatch(entry_id) else None
        if entry is None or (entry is self.live and not self.session.ids):
            raise KeyError(entry_id)
        if idle and entry.busy:
            raise Busy(f"Conversation {entry_id} is answering a request now; retry when it is done.")
        return entry

    def _describe(self, entry: Entry) -> dict:
        live = entry is self.live
        where = (["session"] if live else []) + (["dram"] if entry.held is not None else []) + \
            (["disk"] if entry.disk_bytes else [])
        host = self.session.host if live else entry.held.host if entry.held is not None else None
        return {"id": entry.id, "tokens": len(self.session.ids) if live else len(entry.ids), "where": where,
                "dram_bytes": host.dram_bytes if host is not None else 0,
                "shared_bytes": host.shared_bytes if host is not None else 0,
                "disk_bytes": entry.disk_bytes, "disk_tokens": entry.disk_tokens,
                "last_used": round(entry.last_used, 3)}
