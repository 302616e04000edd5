"""Where every rank is when the ranks stop agreeing: a report on each rank whose collective
fails or times out, naming each rank's collective, its generated-code line and source line.

    before: rank 0: RuntimeError: [gloo] Timed out waiting 10000ms for recv operation
            rank 1: RuntimeError: [gloo] Timed out waiting 10000ms for recv operation
    after:  nncompile: the ranks stopped agreeing (rank 0 waited 5 s in a collective):
              rank 0: all_reduce, forward #3 (eval), gencode0.py:142
                      `comm.all_reduce(h0_attn_c_proj_linear, group=PLAN_GROUP)`, source
                      examples/gpt.py:29 `return self.c_proj(y)`; script train.py:40
              rank 1: barrier; script train.py:44 `dist.barrier()`
            followed by each rank's own error and traceback.

init_distributed starts one daemon thread per rank (a "watch"). Twice a second it looks at the
main thread's Python stack (sys._current_frames: readable while the main thread waits inside
a C++ collective). When the main thread has waited in the same torch.distributed call for half
the timeout (at most timeout - 2 s), the watch asks every rank, through the process group's
store, to say where it is; every watch then keeps its answer current with its main thread's
position, whatever it does (waiting, computing, or in the script's own code), until a
collective it waited in fails (it waited 3/4 of the timeout, or an exception is being handled
as it leaves): then the answer keeps naming that collective. When the
collective fails (gloo and NCCL raise once the timeout passes), an exception that ends the
program prints the report first (an ask older than the timeout + 10 s is not reported), with
the ranks that did not answer (dead, or stuck where Python cannot run) named as such. An
exception that ends a rank's program is put in the store too, so the other ranks' errors
(their next collective fails: the connection drops, or the timeout passes) name the rank and
its error (`rank 0: raised ValueError: ...`). No
collective is added and nothing runs in the training thread; a rank checks one store key
twice a second (and, while it waits in a collective, a second), and the watch ends at exit,
before the interpreter does (Watch.stop).

The watch also answers a narrower question a lockstep exchange asks when it has waited 2 s
(`peers_waiting_on_me`, runtime/protocol/lockstep.py): does this rank wait in a
torch.distributed call, on which group, spanning which ranks, and did the script make it
itself (no frame of nncompile's runtime or a generated program around it). A rank evaluating
alone while the others sit in `dist.barrier()`, or gathering the ZeRO-1/2 optimizer state
alone while they reduce gradients, learns so in seconds, not at the timeout.
NNCOMPILE_HANG_WATCH=0 turns the watch off.
"""
from __future__ import annotations

import atexit
import datetime
import os
import re
import sys
import threading
import time
from types import FrameType

import torch.distributed as dist

from nncompile.compat import default_store, flight_recorder_entries

KEY = "nncompile_hang"
POLL_S = 0.5
_started: list[threading.Thread] = []
_SOURCE = re.compile(r"^\s*# (\S+:\d+)  (.*)$")
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # runtime/..


def _gencode_line(path: str, lineno: int) -> tuple[str, str | None]:
    """The statement at `lineno` of a generated file and the source line it came from (the
    nearest `# file:line  code` comment above it)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return "", None
    stmt = lines[lineno - 1].split("  # ")[0].strip() if 0 < lineno <= len(lines) else ""
    for i in range(lineno - 2, -1, -1):
        m = _SOURCE.match(lines[i])
        if m:
            return stmt, f"{m[1]} `{m[2].strip()}`"
        if lines[i].lstrip().startswith("def "):
            break
    return stmt, None


def _short(s: str, n: int = 90) -> str:
    return s if len(s) <= n else s[:n - 3] + "..."


def wait_for(work, group) -> None:
    """`work.wait()` for a collective nncompile launched asynchronously on `group`, where the
    watch sees it as it sees a blocking torch.distributed call (its report, and
    peers_waiting_on_me, name it and its group)."""
    work.wait()


def _collective_frame(frame: FrameType | None) -> FrameType | None:
    """The frame of the torch.distributed call (or wait_for) the thread at `frame` waits in,
    or None."""
    f = frame
    while f is not None:
        path = f.f_code.co_filename
        if ("distributed_c10d" in path and "torch" in path) or f.f_code is wait_for.__code__:
            return f
        f = f.f_back
    return None


def _in_collective(frame: FrameType | None) -> int | None:
    """The id of the torch.distributed call the thread at `frame` waits in, or None."""
    call = _collective_frame(frame)
    return None if call is None else id(call)


def waiting_collective(frame: FrameType | None) -> tuple[list[int], str, bool] | None:
    """The torch.distributed call the thread at `frame` waits in: (the ranks of its group, the
    group's name, whether the script made it itself: no frame of nncompile's runtime or of a
    generated program around it, as `dist.barrier()` or an `all_reduce` of a logged loss).
    None when it waits in none (or its group cannot be read)."""
    call = _collective_frame(frame)
    if call is None:
        return None
    script = True
    f = call.f_back
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(_PACKAGE_ROOT + os.sep) or \
                os.path.basename(path).startswith("gencode"):
            script = False
            break
        f = f.f_back
    group = call.f_locals.get("group") or dist.GroupMember.WORLD
    try:
        return list(dist.get_process_group_ranks(group)), group.group_name, script
    except (RuntimeError, ValueError, AttributeError):
        return None


def _flight_recorder(thread_id: int | None) -> str | None:
    """The newest collective this thread launched, from torch's Flight Recorder (on when
    TORCH_FR_BUFFER_SIZE > 0, which init_distributed sets): its kind, its number on its
    process group (ranks at different numbers of one group disagree) and the group."""
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) <= 0:
        return None
    entries = flight_recorder_entries()
    mine = [e for e in entries if str(e.get("thread_id")) == str(thread_id)] or entries
    if not mine:
        return None
    e = mine[-1]
    pg_id, desc = (tuple(e.get("process_group", ("?", ""))) + ("",))[:2]
    named = f" ({desc})" if desc and desc != "undefined" else ""
    return f"{e.get('profiling_name', '?')} #{e.get('collective_seq_id')} of group {pg_id}{named}"


def position(frame: FrameType | None) -> tuple[str, int | None]:
    """(where a thread is, in words; the id of the torch.distributed call it waits in, or
    None)."""
    collective, call_id, gen, source, script, forward = None, None, None, None, None, None
    ours = None
    main_file = os.path.abspath(getattr(sys.modules.get("__main__"), "__file__", "") or "")
    f = frame
    while f is not None:
        path = f.f_code.co_filename
        if ours is None and collective is not None and os.path.dirname(
                os.path.dirname(os.path.abspath(path))) == _PACKAGE_ROOT:
            ours = f"in {os.path.basename(path)[:-3]}.{f.f_code.co_name} " \
                   f"({os.path.relpath(path, _PACKAGE_ROOT)}:{f.f_lineno})"
        if collective is None and "distributed_c10d" in path and "torch" in path:
            collective, call_id = f.f_code.co_name, id(f)
        elif collective is None and f.f_code is wait_for.__code__:
            collective, call_id = "a wait for an asynchronous collective", id(f)
        base = os.path.basename(path)
        if forward is None and f.f_code.co_name == "_run" and \
                os.path.basename(path) == "module.py":
            owner = f.f_locals.get("self")              # the ParallelModule's forward
            count = getattr(owner, "__dict__", {}).get("_calls")
            if count is not None:
                forward = f"forward call #{count}" + ("" if getattr(owner, "training", True)
                                                       else " (eval)")
        if gen is None and base.startswith("gencode") and base.endswith(".py"):
            stmt, source = _gencode_line(path, f.f_lineno)
            gen = f"{base}:{f.f_lineno} `{_short(stmt)}`"
        if script is None and main_file and os.path.abspath(path) == main_file:
            script = f"{os.path.basename(path)}:{f.f_lineno}"
            line = _line_of(path, f.f_lineno)
            if line:
                script += f" `{_short(line)}`"
        f = f.f_back
    parts = [collective or "not in a torch.distributed collective"]
    recorded = _flight_recorder(threading.main_thread().ident) if collective else None
    if recorded:
        parts.append(f"flight recorder: {recorded}")
    if ours and not (gen and ours.startswith("in gencode")):
        parts.append(ours)
    if forward:
        parts.append(forward)
    if gen:
        parts.append(gen)
    if source:
        parts.append(f"source {source}")
    if script:
        parts.append(f"script {script}")
    return ", ".join(parts), call_id


def _line_of(path: str, lineno: int) -> str:
    try:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if i == lineno:
                    return line.strip()
    except OSError:
        pass
    return ""


class Watch(threading.Thread):
    """The per-rank watch (module docstring)."""

    def __init__(self, store, rank: int, world: int, timeout_s: float):
        super().__init__(name="nncompile-hang-watch", daemon=True)
        self.store, self.rank, self.world = store, rank, world
        self.patience = max(POLL_S, min(timeout_s / 2, timeout_s - 2))
        self.main = threading.main_thread().ident
        self.waiting: tuple[int | None, float] = (None, 0.0)
        self.answered: str | None = None
        self.asked: int | None = None
        self.fresh_s = timeout_s + 10       # an ask older than that is another episode
        self.failed_after = 0.75 * timeout_s    # left a collective after this long: it failed
        self.frozen = False                 # the answer names the collective that failed
        self.wait_where = (None, "")        # (call, where) of the last long wait in one
        self.peers_answered: str | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(POLL_S):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def stop(self) -> None:
        """End the thread before the interpreter does. A daemon thread still inside a store
        call when Python finalizes is ended by pthread_exit, whose unwinding through torch's
        C++ frames aborts the process ("terminate called without an active exception",
        SIGABRT) after the script has finished; so the watch is stopped at exit and joined
        (a store call gives up after 5 s)."""
        self.stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=10)

    def tick(self) -> None:
        frame = sys._current_frames().get(self.main)
        call = _in_collective(frame)
        now = time.monotonic()
        if call is not None:                # waiting long: where, should that collective fail
            self.frozen = False
            if call == self.waiting[0] != self.wait_where[0] and \
                    now - self.waiting[1] >= self.patience / 2:     # once per wait
                self.wait_where = (call, position(frame)[0])
        elif self.waiting[0] is not None:   # it left a collective: failed, or done?
            self.frozen = self.wait_where[0] == self.waiting[0] and (
                now - self.waiting[1] >= self.failed_after
                or sys._current_exceptions().get(self.main) is not None)
        if call is None or call != self.waiting[0]:
            self.waiting = (call, now)
        elif now - self.waiting[1] >= self.patience and self.asked != call:
            self.asked = call               # one ask per wait: the answers are refreshed
            self.store.set(f"{KEY}/ask", f"{time.time()}|rank {self.rank} waited "
                                         f"{now - self.waiting[1]:.0f} s in a collective")
        if self.store.check([f"{KEY}/ask"]):
            # what the others read is where this rank is now; after a collective failed
            # (timed out, or its error is being handled), still that collective
            where = self.wait_where[1] if self.frozen else position(frame)[0]
            if where != self.answered:
                self.store.set(f"{KEY}/{self.rank}", where)
                self.answered = where
        # a lockstep exchange waits for this rank (lockstep.py): say so if the script's own
        # collective keeps it away (only a rank waiting in a collective looks)
        if call is not None and self.store.check([f"{KEY}/peers"]):
            stamp = self.store.get(f"{KEY}/peers").decode()
            found = waiting_collective(frame)
            answer = stamp + ("|" if found is None else
                              f"|{','.join(map(str, found[0]))}|{found[1]}|{int(found[2])}")
            if answer != self.peers_answered:
                self.store.set(f"{KEY}/peers/{self.rank}",
                               f"{answer}|{position(frame)[0] if found else ''}")
                self.peers_answered = answer

    def publish_error(self, kind, value) -> None:
        """An exception ending this rank: the others' reports name it."""
        try:
            text = f"{kind.__name__}: {value}".strip().splitlines()[0][:300]
            self.store.set(f"{KEY}/error/{self.rank}", text)
        except Exception:  # noqa: BLE001 - the store went away with the job
            pass

    def _errors(self) -> dict[int, str]:
        return {r: self.store.get(f"{KEY}/error/{r}").decode() for r in range(self.world)
                if self.store.check([f"{KEY}/error/{r}"])}

    def report(self, wait_s: float = 3.0) -> str | None:
        """Every rank's answer (waiting up to wait_s for the missing) and the errors other
        ranks ended with; None when no rank asked recently and no other rank failed."""
        try:
            asked = None
            if self.store.check([f"{KEY}/ask"]):
                asked_at, text = self.store.get(f"{KEY}/ask").decode().split("|", 1)
                asked = text if time.time() - float(asked_at) <= self.fresh_s else None
            errors = self._errors()
            if asked is None and not (errors.keys() - {self.rank}):
                return None
            rows = {}
            deadline = time.monotonic() + (wait_s if asked is not None else 0)
            while True:
                for r in range(self.world):
                    if r not in rows and self.store.check([f"{KEY}/{r}"]):
                        rows[r] = self.store.get(f"{KEY}/{r}").decode()
                if len(rows) == self.world or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store went away with the job
            return None
        if asked is None:
            rows = {}                       # no recent ask: positions would be stale
        why = asked or "rank " + ", ".join(str(r) for r in sorted(errors)) + " failed"
        lines = [f"nncompile: the ranks stopped agreeing ({why}); where each rank is:"]
        for r in range(self.world):
            row = rows.get(r, "no answer (the process is gone, or stuck where Python cannot "
                              "run)" if asked else "")
            if r in errors:
                row = (f"{row}; then raised " if rows.get(r) else "raised ") + errors[r]
            if row:
                lines.append(f"  rank {r}: {row}")
        return "\n".join(lines)


def _own_store():
    """A client of the job's store of its own, with a short timeout: a report must not wait
    out the process group's timeout on a store whose host died with its rank. torchrun's
    MASTER_ADDR:MASTER_PORT (this attempt's keys), else the default group's store."""
    prefix = f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{KEY}"
    try:
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               is_master=False, timeout=datetime.timedelta(seconds=5),
                               wait_for_workers=False)
    except (KeyError, ValueError, RuntimeError):
        client = default_store()
    return dist.PrefixStore(prefix, client)


def start(timeout_s: float) -> None:
    """Start this rank's watch (once per process; init_distributed calls it)."""
    if _started or not dist.is_initialized() or dist.get_world_size() < 2 or \
            os.environ.get("NNCOMPILE_HANG_WATCH", "1") == "0":
        return
    store = _own_store()
    watch = Watch(store, dist.get_rank(), dist.get_world_size(), timeout_s)
    watch.start()
    _started.append(watch)
    atexit.register(watch.stop)
    previous = sys.excepthook

    def report_then(kind, value, tb):
        watch.publish_error(kind, value)
        text = watch.report()
        if text:
            print(text, file=sys.stderr, flush=True)
        previous(kind, value, tb)
        if getattr(value, "_ends_job", False):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    sys.excepthook = report_then


def ends_job(error: BaseException) -> BaseException:
    """Mark `error` as one after which no rank of the job can go on (this rank and a peer
    wait for each other in different collectives): left uncaught, the process exits as soon
    as it is printed. A normal exit would first wait for the peers in torch's teardown of the
    process group, which they reach only at the transport's timeout; the launcher (torchrun)
    stops them once this rank has exited."""
    error._ends_job = True
    return error


def watching(group) -> bool:
    """Whether this process's watch runs and `group` is one of real processes (not simulated
    threads), so that peers_waiting_on_me can ask where its ranks are."""
    return bool(_started) and "threaded" not in str(dist.get_backend(group)).lower()


def peers_waiting_on_me(ranks: list[int], exchange, script_only: bool = True,
                        wait_s: float = 2.0) -> dict[int, str]:
    """{rank: where it is} for those of `ranks` waiting in a torch.distributed call that
    spans this rank on another group than `exchange` (the group this rank waits on): a call
    that cannot end before this rank joins it, so this rank's exchange with them can never
    end either. `script_only`: count only the script's own calls (`dist.barrier()`), as a
    forward's exchange does; nncompile's own may be one this rank already launched
    asynchronously. Asked through the store (each rank's watch answers within POLL_S);
    ranks that do not answer in `wait_s` are left out."""
    watch = _started[0]
    me = dist.get_rank()
    stamp = f"{me}:{time.time()}"
    watch.store.set(f"{KEY}/peers", stamp)
    found, pending = {}, set(ranks)
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        time.sleep(POLL_S / 5)
        for r in list(pending):
            key = f"{KEY}/peers/{r}"
            if not watch.store.check([key]):
                continue
            got, spans, name, script, where = \
                (watch.store.get(key).decode().split("|", 4) + [""] * 4)[:5]
            if got != stamp:
                continue                      # an answer to an earlier question
            pending.discard(r)
            if spans and me in {int(x) for x in spans.split(",")} and \
                    name != exchange.group_name and (script == "1" or not script_only):
                found[r] = where
    try:
        watch.store.delete_key(f"{KEY}/peers")    # the watches stop reading the question
    except (RuntimeError, NotImplementedError):
        pass
    return found


def report() -> str | None:
    """The report of this process's watch (None: none started, or no rank asked)."""
    return _started[0].report() if _started else None
