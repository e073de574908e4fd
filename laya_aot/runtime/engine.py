"""One device process for many serving workers: `laya-aot serve` with LAYA_AOT_WORKERS=N and LAYA_AOT_ENGINE=1.

Each worker of `laya-aot serve` is a whole server: HTTP, laya's request handling, tokenising, decoding, the
batcher, and its own CUDA context and weights. Several workers raise what the host can answer, but each merges
only the requests its own connections bring, and their kernels take turns on the GPU. With LAYA_AOT_ENGINE=1 the
supervisor starts one engine process (this module) before the workers: it loads every bundled checkpoint with
`laya_aot.load`, as one process would, and runs every artifact call; the workers keep everything else and load a
thin laya agent on the CPU (no weights) whose forward is a `RemoteBackend`: the collated rows go to the engine,
the outputs come back. The engine merges the calls that wait for it into one artifact call per checkpoint and
length group (rows padded to the longest, markers to the most; each call's rows and markers sliced back out), so
the GPU runs one call for what several workers sent at once.

The engine listens on a Unix socket in a private directory, with a random key the supervisor hands to its
children (`multiprocessing.connection`'s handshake): only the server's own processes talk to it. A call that
fails in the engine fails the worker's request with the engine's error; a merged call that fails is run again
call by call, so a bad call does not fail its neighbours. The engine exiting stops the server (the supervisor
watches it as it watches the workers). A checkpoint stays loaded in the engine while a worker holds an agent for
it: when the last worker's agent goes (laya's eviction or idle unload there) or its connection closes, the engine
drops it and frees its device memory, as one process's unload would.
"""
from __future__ import annotations

import gc
import logging
import os
import pickle
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import LayaAotError

log = logging.getLogger("laya_aot.serve")

ENV_ENGINE = "LAYA_AOT_ENGINE"                # 1: the workers' artifact calls run in one engine process
ENV_ENGINE_ADDRESS = "LAYA_AOT_ENGINE_ADDRESS"  # set by the supervisor: the engine's socket
ENV_ENGINE_KEY = "LAYA_AOT_ENGINE_KEY"        # set by the supervisor: the handshake's key (hex)
ENV_ENGINE_READY_FD = "LAYA_AOT_ENGINE_READY_FD"  # set by the supervisor in the engine: where it says it listens
MAX_MERGED_ROWS = 64                          # rows of one merged call at most (the artifacts' row range)
READY = b"ready"
REMOTE = "engine:"  # a remote backend's name: this prefix, then what serves the checkpoint in the engine

Tensors = Tuple[Any, ...]


class EngineError(LayaAotError, RuntimeError):
    """The engine answered a request with an error, or is gone."""


class EngineGone(EngineError):
    """The engine process is gone (killed, crashed): no request to it is answered again; its supervisor is stopping
    the server. Not the request's fault: `laya-aot serve` answers it with laya's 503."""


# ------------------------------------------------------------------------------------------------ merging
def merge(calls: Sequence[Tensors], pad_id: int) -> Tuple[Tensors, List[Tuple[int, int, int]]]:
    """One artifact call's inputs for `calls` (each `(ids, att, mpos, mmask, qtype)`): rows stacked, tokens padded
    to the longest with `pad_id` (attention 0), markers to the most (position 0, masked); and each call's
    (first row, rows, markers) to slice its outputs back."""
    import torch

    tokens = max(c[0].shape[1] for c in calls)
    markers = max(c[2].shape[1] for c in calls)

    def padded(x: Any, width: int, value: Any) -> Any:
        if x.shape[1] == width:
            return x
        return torch.cat([x, x.new_full((x.shape[0], width - x.shape[1]), value)], 1)

    parts: List[List[Any]] = [[], [], [], [], []]
    spans, row = [], 0
    for ids, att, mpos, mmask, qtype in calls:
        parts[0].append(padded(ids, tokens, pad_id))
        parts[1].append(padded(att, tokens, 0))
        parts[2].append(padded(mpos, markers, 0))
        parts[3].append(padded(mmask, markers, False))
        parts[4].append(qtype)
        spans.append((row, ids.shape[0], mpos.shape[1]))
        row += ids.shape[0]
    return tuple(torch.cat(p) for p in parts), spans


def split(outputs: Sequence[Any], spans: Sequence[Tuple[int, int, int]]) -> List[Tensors]:
    """Each call's outputs from a merged call's: its rows of each, and of the forward's first output (the logits
    per marker) its own markers. The second, the action logits, is one column per action, whatever their number:
    an action count equal to the merged marker count is not a marker dimension."""
    out = []
    for first, rows, own in spans:
        logits, *rest = outputs
        out.append((logits[first:first + rows, :own].clone(), *(o[first:first + rows].clone() for o in rest)))
    return out


def by_length(calls: Sequence["_Call"]) -> List[List["_Call"]]:
    """`calls` in the batcher's length groups (`batcher.length_groups` of their token widths): each worker's batcher
    groups its own requests by length, and a merged call across workers must not pad a short call to a long one's
    width (a 40-token row padded to 1,000 costs the 1,000-token forward)."""
    from .batcher import length_groups

    groups: Dict[int, List["_Call"]] = {}
    for c, g in zip(calls, length_groups([c.inputs[0].shape[1] for c in calls])):
        groups.setdefault(g, []).append(c)
    return [groups[g] for g in sorted(groups)]


# ------------------------------------------------------------------------------------------------ messages
def _send(conn: Connection, message: Tuple[Any, ...]) -> None:
    """`message` pickled by the standard pickler: tensors by value. (`Connection.send` pickles as multiprocessing
    does, where torch shares a tensor's memory through a side channel that needs the sender's own process key.)"""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def pack(tensors: Sequence[Any]) -> List[Tuple[Any, str]]:
    """CPU tensors as (numpy array, torch dtype name) for a message: numpy arrays pickle as their bytes (a torch
    tensor's storage pickles through `torch.save`, about a millisecond each); bf16, which numpy lacks, travels as
    fp32 (exact) and is made bf16 again by `unpack`."""
    import torch

    out = []
    for t in tensors:
        t = t.detach().cpu().contiguous()
        out.append(((t.float() if t.dtype == torch.bfloat16 else t).numpy(), str(t.dtype).replace("torch.", "")))
    return out


def unpack(packed: Sequence[Tuple[Any, str]]) -> Tuple[Any, ...]:
    import torch

    return tuple(torch.from_numpy(a).to(getattr(torch, dtype)) for a, dtype in packed)


# --------------------------------------------------------------------------------------------- the engine
@dataclass
class _Call:
    key: str
    inputs: Tensors
    extra: Dict[str, Any]
    reply: Callable[[Tuple[str, Any]], None]


@dataclass
class Engine:
    """Loads bundled checkpoints on request (`load(key, request) -> agent`) and runs their artifact calls, merging
    the calls waiting for the same checkpoint into one."""

    load: Callable[[str, Dict[str, Any]], Any]
    describe_agent: Callable[[Any], Dict[str, Any]]
    agents: Dict[str, Any] = field(default_factory=dict)
    holds: Dict[str, int] = field(default_factory=dict)  # per checkpoint: the workers' agents for it alive
    calls: "queue.Queue[_Call]" = field(default_factory=queue.Queue)
    # calls taken, artifact calls made (merged ones among them); the device thread's seconds idle, in the artifact's
    # forward (its outputs on the host) and in the rest (merging, splitting, answering)
    stats: Dict[str, float] = field(default_factory=lambda: {"calls": 0, "artifact_calls": 0, "merged_calls": 0,
                                                             "idle_s": 0.0, "forward_s": 0.0, "host_s": 0.0})
    _loading: threading.Lock = field(default_factory=threading.Lock)

    def describe(self, key: str, request: Dict[str, Any]) -> Dict[str, Any]:
        """Load `key` once (the first worker's request loads it; the others wait and share it); what serves it."""
        with self._loading:
            if key not in self.agents:
                self.agents[key] = self.load(key, request)
            agent = self.agents[key]
            self.holds[key] = self.holds.get(key, 0) + 1
        backend = agent.backend_object
        try:
            return {"describe": self.describe_agent(agent), "pad_id": getattr(backend, "pad_id", 0),
                    "load_stats": dict(getattr(backend, "load_stats", None) or {})}
        except BaseException:
            self.release(key)  # the worker gets the error and no agent: it holds nothing
            raise

    def release(self, key: str, n: int = 1) -> None:
        """`n` of the workers' agents for `key` are gone: with the last, the checkpoint leaves the engine (a call
        the device thread already took keeps its own reference and finishes)."""
        with self._loading:
            left = self.holds.get(key, 0) - n
            if left > 0:
                self.holds[key] = left
                return
            self.holds.pop(key, None)
            agent = self.agents.pop(key, None)
        if agent is not None:
            del agent
            gc.collect()
            _empty_device_cache()
            log.info("laya-aot engine: %r unloaded: no worker holds it", key)

    def run(self) -> None:
        """The device thread: each call with the calls for its checkpoint that wait behind it, as one."""
        stats = self.stats
        while True:
            t0 = time.perf_counter()
            first = self.calls.get()
            t1 = time.perf_counter()
            stats["idle_s"] += t1 - t0
            batch, later = [first], []
            rows = first.inputs[0].shape[0]
            while True:
                try:
                    nxt = self.calls.get_nowait()
                except queue.Empty:
                    break
                fits = (nxt.key == first.key and not nxt.extra and not first.extra
                        and rows + nxt.inputs[0].shape[0] <= MAX_MERGED_ROWS)
                (batch if fits else later).append(nxt)
                rows += nxt.inputs[0].shape[0] if fits else 0
            forward_before = stats["forward_s"]
            for calls in by_length(batch) + [[c] for c in later]:
                try:
                    self._answer(calls)
                except BaseException as e:  # noqa: BLE001 - the device thread outlives anything; no call waits for ever
                    log.exception("laya-aot engine: a call failed outside its requests")
                    for c in calls:
                        c.reply(("error", type(e).__name__, str(e)))
            stats["host_s"] += time.perf_counter() - t1 - (stats["forward_s"] - forward_before)

    def _answer(self, batch: List[_Call]) -> None:
        import torch

        agent = self.agents.get(batch[0].key)
        if agent is None:
            for c in batch:
                c.reply(("error", "EngineError", "checkpoint %r is not loaded in the engine" % c.key))
            return
        backend = agent.backend_object
        self.stats["calls"] += len(batch)
        if len(batch) > 1:
            try:
                inputs, spans = merge([c.inputs for c in batch], getattr(backend, "pad_id", 0))
                t0 = time.perf_counter()
                with torch.no_grad():
                    outs = [o.detach().cpu() for o in backend.forward(*inputs)]
                self.stats["forward_s"] += time.perf_counter() - t0
                self.stats["artifact_calls"] += 1
                self.stats["merged_calls"] += 1
                for c, part in zip(batch, split(outs, spans)):
                    c.reply(("ok", pack(part)))
                return
            except Exception:  # noqa: BLE001 - each call again by itself: one bad call fails alone
                log.debug("laya-aot engine: a merged call failed; its calls run one by one", exc_info=True)
        for c in batch:
            try:
                t0 = time.perf_counter()
                with torch.no_grad():
                    outs = [o.detach().cpu() for o in backend.forward(*c.inputs, **c.extra)]
                self.stats["forward_s"] += time.perf_counter() - t0
                self.stats["artifact_calls"] += 1
                c.reply(("ok", pack(outs)))
            except Exception as e:  # noqa: BLE001 - the worker's request fails with it, nothing else does
                c.reply(("error", type(e).__name__, str(e)))

    def serve(self, listener: Listener) -> None:
        """Accept the workers' connections, one reader thread each; the device thread runs the calls."""
        threading.Thread(target=self.run, name="laya-aot-engine", daemon=True).start()
        while True:
            conn = listener.accept()
            threading.Thread(target=self._reader, args=(conn,), name="laya-aot-engine-conn", daemon=True).start()

    def _reader(self, conn: Connection) -> None:
        lock = threading.Lock()
        held: Dict[str, int] = {}  # what this worker holds: released when its connection closes

        def reply(message: Tuple[str, Any], tag: int) -> None:
            with lock:
                try:
                    _send(conn, (tag,) + tuple(message))
                except OSError:
                    pass  # the worker is gone

        while True:
            try:
                tag, op, key, payload = _recv(conn)
            except (EOFError, OSError):
                for key, n in held.items():
                    self.release(key, n)
                return
            if op == "load":
                try:
                    reply(("ok", self.describe(key, payload)), tag)
                    held[key] = held.get(key, 0) + 1
                except Exception as e:  # noqa: BLE001 - the worker raises it as its load's error
                    reply(("error", type(e).__name__, str(e)), tag)
            elif op == "release":
                if held.get(key, 0) > 0:
                    held[key] -= 1
                    self.release(key)
            elif op == "forward":
                inputs, extra = payload
                self.calls.put(_Call(key, unpack(inputs), {k: unpack([v])[0] for k, v in extra.items()},
                                     lambda m, t=tag: reply(m, t)))
            elif op == "stats":
                agent = self.agents.get(key)
                reply(("ok", {"engine": dict(self.stats),
                              "backend": dict(getattr(getattr(agent, "backend_object", None), "stats", {}) or {})}),
                      tag)


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ workers
class EngineClient:
    """A worker's connection to the engine: requests answered in any order, each waited for by its caller."""

    def __init__(self, address: str, key: bytes):
        self._conn = Client(address, family="AF_UNIX", authkey=key)
        self._lock = threading.Lock()
        self._waiting: Dict[int, "queue.Queue[Tuple[Any, ...]]"] = {}
        self._tag = 0
        self._gone: Optional[str] = None
        self._notes: "queue.SimpleQueue[Tuple[str, str]]" = queue.SimpleQueue()  # put is safe in a gc callback
        threading.Thread(target=self._read, name="laya-aot-engine-client", daemon=True).start()
        threading.Thread(target=self._notify, name="laya-aot-engine-notes", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                tag, *answer = _recv(self._conn)
            except (EOFError, OSError) as e:
                with self._lock:  # no request registers after this without seeing it
                    self._gone = "the engine process is gone (%s)" % (type(e).__name__,)
                    waiting, self._waiting = list(self._waiting.values()), {}
                for q in waiting:
                    q.put(("gone", self._gone))
                return
            with self._lock:
                q = self._waiting.pop(tag, None)
            if q is not None:
                q.put(tuple(answer))

    def notify(self, op: str, key: str) -> None:
        """A message the engine does not answer, sent from the client's own thread: a garbage collector's callback
        may call this while this thread is inside a send, which must not be re-entered."""
        self._notes.put((op, key))

    def _notify(self) -> None:
        while True:
            op, key = self._notes.get()
            with self._lock:
                if self._gone:
                    return
                try:
                    _send(self._conn, (0, op, key, None))
                except OSError:
                    return

    def request(self, op: str, key: str, payload: Any) -> Any:
        q: "queue.Queue[Tuple[Any, ...]]" = queue.Queue(1)
        with self._lock:
            if self._gone:
                raise EngineGone(self._gone)
            self._tag += 1
            tag = self._tag
            self._waiting[tag] = q
            try:
                _send(self._conn, (tag, op, key, payload))
            except OSError as e:
                self._waiting.pop(tag, None)
                raise EngineGone("the engine process is gone (%s)" % type(e).__name__) from None
        answer = q.get()
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "gone":
            raise EngineGone(answer[1])
        raise EngineError("%s: %s" % (answer[1], answer[2]))


_CLIENT: Optional[EngineClient] = None
_CLIENT_LOCK = threading.Lock()


def client(env: Optional[Mapping[str, str]] = None) -> Optional[EngineClient]:
    """This worker's connection to the engine (None where the server runs without one)."""
    global _CLIENT
    env = os.environ if env is None else env
    address = env.get(ENV_ENGINE_ADDRESS)
    if not address:
        return None
    with _CLIENT_LOCK:
        if _CLIENT is None:
            _CLIENT = EngineClient(address, bytes.fromhex(env[ENV_ENGINE_KEY]))
        return _CLIENT


def remote_agent(engine: EngineClient, key: str, checkpoint: str, request: Dict[str, Any],
                 agent_kwargs: Dict[str, Any]) -> Any:
    """A thin laya agent on the CPU for `checkpoint` whose forward runs in the engine (which loads it first)."""
    from .. import laya_internals as laya_api
    from ..laya_internals import Backend

    described = engine.request("load", key, request)

    class RemoteBackend(Backend):
        """The engine's artifact as this agent's forward: the collated rows there, the outputs back."""

        def __init__(self, agent: Any):
            super().__init__(agent)
            info = described["describe"]
            self.name = "%s%s" % (REMOTE, info["backend"])
            self.described = info  # what the engine said serves it (serve's `describe` shows it)
            self.artifact = _Named(info["artifact"]) if info["artifact"] else None
            self.variant = info.get("variant")
            self.rejected = [tuple(r.split(": ", 1)) for r in info.get("refused", [])]
            self.load_stats = described["load_stats"]
            self.pad_id = described["pad_id"]

        @property
        def stats(self) -> Dict[str, Any]:
            """The engine's artifact's calls, and the engine's own (`Engine.stats`: merging, and where its device
            thread's time went) under "engine"."""
            try:
                got = engine.request("stats", key, None)
            except EngineError:
                return {}
            out = dict(got["backend"])
            out["engine"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in got["engine"].items()}
            return out

        def forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder=False,
                    **extra):
            inputs = pack((input_ids, attention_mask, marker_pos, marker_mask, qtype))
            outs = engine.request("forward", key, (inputs, {k: pack([v])[0] for k, v in extra.items()}))
            return tuple(o.to(input_ids.device) for o in unpack(outs))

    kwargs = dict(agent_kwargs, device="cpu")
    agent = laya_api.thin_agent(checkpoint, **kwargs)
    laya_api.install_backend(agent, RemoteBackend(agent))
    weakref.finalize(agent, _release, engine, key)  # laya's eviction or idle unload here frees it there
    return agent


def _release(engine: EngineClient, key: str) -> None:
    """Tell the engine one agent for `key` is gone (no answer awaited: nothing here depends on it)."""
    engine.notify("release", key)


@dataclass(frozen=True)
class _Named:
    name: str


# --------------------------------------------------------------------------------------------- the process
def serve_engine(engine: Engine, env: Optional[Mapping[str, str]] = None) -> int:
    """The engine process's life (`laya-aot serve` run by its supervisor as the engine): listen where the supervisor
    said, tell it the engine is ready (a byte on LAYA_AOT_ENGINE_READY_FD), then serve the workers until killed."""
    env = os.environ if env is None else env
    listener = Listener(env[ENV_ENGINE_ADDRESS], family="AF_UNIX", authkey=bytes.fromhex(env[ENV_ENGINE_KEY]))
    ready = int(env[ENV_ENGINE_READY_FD])
    os.write(ready, READY)
    os.close(ready)
    engine.serve(listener)
    return 0
