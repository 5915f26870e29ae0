"""The watchdog: a stuck or dead rank ends the job in about parallel.timeout_seconds, with one message
naming the rank and what it was doing.

    dog = Watchdog.start(rank, world, timeout_seconds)     # after init_process_group
    dog.doing("reading the batch for step 12")             # the training loop says what it does
    ...
    dog.stop()

Every rank runs one daemon thread that wakes every few seconds and
  - writes this rank's heartbeat (a counter, its activity, host and pid) to the c10d store of the job
    (a connection of its own to the store torchrun provides, MASTER_ADDR:MASTER_PORT);
  - fails the job when this rank has been on one activity longer than the timeout (a rank stuck outside
    collectives: data loading, a hung filesystem; or waiting in a collective for such a rank);
  - fails the job when the next rank's heartbeat has not moved for longer than the timeout (a frozen
    or dead process cannot report itself);
  - exits quietly when another rank has already failed the job;
  - stops using the store once this node's launcher is gone and the store with it (the worker then
    saves and leaves on the kernel's SIGTERM; a dead socket would only fill the log).
Collective timeouts (every process group has parallel.timeout_seconds) lead to the same report.
The first rank to fail the job takes the report (an atomic counter in the store), reads every
rank's heartbeat twice to find the culprit (a rank whose heartbeat stopped, else the rank that is
furthest behind), prints one `error:` line, and every rank exits with status 1; a frozen rank on the
same host is killed, so the launcher sees every worker end.

A rank that raises an error (bad input, or a bug) reports it itself (`report`): the first such rank
prints its line, and the others, wherever they wait, end at their next check instead of at the timeout.
Every rank that ends leaves the job's message in torchrun's error file, the "Root Cause" of its report.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, NoReturn, Optional

import torch.distributed as dist

from megalysses.distributed import launcher_status, write_error_file


def _store(rank: int, timeout: float) -> Optional[dist.Store]:
    """A store connection of the watchdog's own (a blocked main thread never holds it up), or None
    when the job has no TCP store (a single process)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=max(timeout, 30.0)),
                          wait_for_workers=False)
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"megalysses/watchdog/{run}/", store)


def _reachable() -> bool:
    """Whether the job's store still accepts connections (a plain socket: no c10d errors on the way)."""
    try:
        socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=2).close()
        return True
    except (KeyError, ValueError, OSError):
        return False


class _Ended(BaseException):
    """The job was ended but the process lives on (an `exit` that returns, in tests)."""


class Watchdog:
    def __init__(self, rank: int, world: int, timeout: float, store: Optional[dist.Store],
                 interval: Optional[float] = None, exit: Callable[[int], None] = os._exit) -> None:
        self.rank, self.world, self.timeout, self.store = rank, world, timeout, store
        self.slack = 1.0           # activities may last slack x timeout (allow)
        self.interval = interval or min(5.0, max(0.5, timeout / 5))
        self._exit = exit
        self._activity: tuple[str, float, int] = ("starting up", time.monotonic(), 0)
        self._beat = 0
        self._failing = threading.Lock()
        self._stopped = threading.Event()
        self._changed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megalysses-watchdog", daemon=True)
        self._launcher_checked = False
        self._launcher_lock = threading.Lock()

    @classmethod
    def start(cls, rank: int, world: int, timeout: float) -> "Watchdog":
        dog = cls(rank, world, timeout, _store(rank, timeout) if world > 1 else None)
        dog._beat_once()
        dog._thread.start()
        return dog

    def doing(self, what: str) -> None:
        """What the main thread does from now on (shown if the job has to end while it does it)."""
        self._activity = (what, time.monotonic(), self._activity[2] + 1)
        self._changed.set()

    @property
    def current(self) -> str:
        return self._activity[0]

    def allow(self, factor: float) -> None:
        """From now on an activity may last `factor` times the timeout, and the next rank's heartbeat may pause as
        long (the profiled steps, and the writing of their traces, which the other ranks wait for); 1 puts the
        timeout back."""
        self.slack = factor

    def stop(self) -> None:
        """The run is over on this rank: stop watching, and tell the others this rank leaves on purpose."""
        self._stopped.set()
        try:
            self._beat_once(leaving=True)
        except Exception:  # noqa: BLE001 - the store may already be gone with the launcher
            pass

    # ------------------------------------------------------------------------- the thread

    def _store_now(self) -> Optional[dist.Store]:
        """The store, or None while this node's launcher is exiting, and for good once it is gone and took
        the store with it (the store lives in the launcher of the job's first node; another node's store
        that still answers is kept). The worker itself then saves and leaves on the kernel's SIGTERM."""
        with self._launcher_lock:                  # one thread probes, the other waits for its answer
            if self.store is None or self._launcher_checked:
                return self.store
            status = launcher_status()
            if status == "exiting":
                return None
            if status == "gone":
                if not _reachable():
                    self.store = None
                self._launcher_checked = True
            return self.store

    def _beat_once(self, leaving: bool = False) -> None:
        what, since, ticks = self._activity
        self._beat += 1
        store = self._store_now()
        if store is not None:
            record = {"beat": self._beat, "doing": what, "for": round(time.monotonic() - since, 1), "ticks": ticks,
                      "host": socket.gethostname(), "pid": os.getpid(), "leaving": leaving}
            store.set(f"hb/{self.rank}", json.dumps(record))

    def _run(self) -> None:
        try:
            self._watch()
        except _Ended:
            pass

    def _watch(self) -> None:
        neighbour = (self.rank + 1) % self.world
        seen, changed, store_down = None, time.monotonic(), None
        due = time.monotonic() + self.interval
        while not self._stopped.is_set():
            # publish a new activity soon after it starts (at most 4 times an interval), check every interval
            self._changed.wait(max(0.0, due - time.monotonic()))
            self._changed.clear()
            if self._stopped.wait(self.interval / 4) or time.monotonic() < due:
                self._publish()
                continue
            now = time.monotonic()
            due = now + self.interval
            what, since, _ = self._activity
            try:
                self._beat_once()
                store = self._store_now()
                if store is None:                    # no neighbour to watch meanwhile
                    changed = now
                else:
                    if store.check(["abort"]):
                        self._quit()
                    rec = self._heartbeat_of(store, neighbour)
                    if rec is not None and (rec["beat"] != seen or rec.get("leaving")):  # alive, or finished on purpose
                        seen, changed = rec["beat"], now
                store_down = None
            except Exception as e:  # noqa: BLE001 - the store (on the first node's launcher) is unreachable
                store_down = store_down or now
                if now - store_down > self.timeout:
                    self.fail(f"rank {self.rank} lost the job's c10d store ({type(e).__name__}): the launcher of "
                              f"the first node is gone", diagnose=False)
            if self._stopped.is_set():
                return
            limit = self.timeout * self.slack
            if now - since > limit:
                self.fail(f"rank {self.rank} has spent {now - since:.0f} s {what}")
            if self.world > 1 and now - changed > limit:
                self.fail(f"rank {neighbour} stopped responding (no heartbeat for {now - changed:.0f} s)")

    def _heartbeat_of(self, store: dist.Store, rank: int) -> Optional[dict]:
        """The heartbeat record rank `rank` last published, or None (none yet, or this is the job's one rank)."""
        if self.world > 1 and store.check([f"hb/{rank}"]):
            return json.loads(store.get(f"hb/{rank}"))
        return None

    def _publish(self) -> None:
        try:
            self._beat_once()
        except Exception:  # noqa: BLE001 - the next check reports a store that stays unreachable
            pass

    def _quit(self, wait: float = 0.0) -> NoReturn:
        """Another rank reports: wait (up to `wait` s) for its verdict, kill the frozen ranks it names, exit."""
        frozen: list = []
        deadline = time.monotonic() + wait
        try:
            while not self.store.check(["abort"]) and time.monotonic() < deadline:
                time.sleep(0.2)
            frozen = json.loads(self.store.get("frozen")) if self.store.check(["frozen"]) else []
            if self.store.check(["abort"]):
                write_error_file(self.store.get("abort").decode())
        except Exception:  # noqa: BLE001 - the store is gone: nothing more to learn
            pass
        self._kill_frozen({rec["rank"]: rec for rec in frozen})
        self._exit(1)
        raise _Ended()   # only reached when `exit` is replaced (tests)

    # ------------------------------------------------------------------------- ending the job

    def report(self, message: str) -> None:
        """This rank stops with an error: print `message` unless another rank already reported the job's
        end, and have every rank still running end at its next check (its error file says why)."""
        self._stopped.set()
        store, claimed = self._store_now(), True
        if store is not None:
            try:
                claimed = store.add("claim", 1) == 1
                if claimed:
                    store.set("frozen", "[]")
                    store.set("abort", message)
            except Exception:  # noqa: BLE001 - no store: every rank says what it knows
                claimed = True
        if claimed:
            print(message, flush=True)
        write_error_file(message)

    def fail(self, reason: str, diagnose: bool = True) -> NoReturn:
        """End the job: one message (from whichever rank claims the report), exit status 1 everywhere."""
        if not self._failing.acquire(blocking=False):      # the other thread is already at it
            self._stopped.wait()
            time.sleep(3600)
        self._stopped.set()
        store = self._store_now()
        claimed, records = True, {}
        if store is not None:
            try:
                claimed = store.add("claim", 1) == 1
                if not claimed:                    # say so, so that the reporter does not take us for frozen
                    self._beat_once(leaving=True)
                    self._quit(wait=3 * self.interval + 10)
                if diagnose:
                    records = self._diagnosis()
            except Exception:  # noqa: BLE001 - no store: every rank reports what it knows
                claimed = True
        if claimed:
            message = (f"error: {self._culprit(reason, records)}; ending the job (parallel.timeout_seconds="
                       f"{self.timeout:g}: raise it if this activity is legitimately that slow)")
            print(message, flush=True)
            sys.stderr.flush()
            write_error_file(message)
            if store is not None:
                try:
                    frozen = [{**rec, "rank": r} for r, rec in records.items() if rec.get("frozen")]
                    store.set("frozen", json.dumps(frozen))
                    store.set("abort", message)
                except Exception:  # noqa: BLE001
                    pass
        self._kill_frozen(records)
        self._exit(1)
        raise _Ended()

    def _heartbeats(self) -> dict[int, dict]:
        out = {}
        if self.store is None:
            return out
        for r in range(self.world):
            try:
                if self.store.check([f"hb/{r}"]):
                    out[r] = json.loads(self.store.get(f"hb/{r}"))
            except Exception:  # noqa: BLE001
                pass
        return out

    def _diagnosis(self) -> dict[int, dict]:
        """Every rank's last heartbeat, with `frozen` set where it did not move over 1.5 intervals."""
        first = self._heartbeats()
        time.sleep(1.5 * self.interval)
        second = self._heartbeats()
        for r in range(self.world):
            rec = second.get(r) or first.get(r) or {"beat": None, "doing": "starting up", "ticks": -1, "for": 0}
            rec["frozen"] = not rec.get("leaving") and (r not in second or
                                                        first.get(r, {}).get("beat") == second[r]["beat"])
            second[r] = rec
        second[self.rank]["frozen"] = False
        return second

    def _culprit(self, reason: str, records: dict[int, dict]) -> str:
        if not records:
            return reason
        frozen = sorted(r for r, rec in records.items() if rec["frozen"])
        if frozen:
            named = ", ".join(f"rank {r} ({records[r].get('host', '?')}, pid {records[r].get('pid', '?')})"
                              for r in frozen[:4])
            doing = records[frozen[0]]["doing"]
            return f"{named} stopped responding (frozen or dead) while {doing}"
        behind = min(rec["ticks"] for rec in records.values())
        late = sorted(r for r, rec in records.items() if rec["ticks"] == behind)
        if len(late) == len(records):
            return reason + " (every rank was there)"
        rec = records[late[0]]
        others = ", ".join(f"rank {r}" for r in late[:4])
        return f"{others} has spent {rec['for']:.0f} s {rec['doing']} while the other ranks waited"

    def _kill_frozen(self, records: dict[int, dict]) -> None:
        """SIGKILL frozen ranks of this host (verified to run the same command line as this process)."""
        host = socket.gethostname()
        try:
            me = open("/proc/self/cmdline", "rb").read()
        except OSError:
            return
        for rec in records.values():
            pid = rec.get("pid")
            if not rec.get("frozen") or rec.get("host") != host or not pid or pid == os.getpid():
                continue
            try:
                if open(f"/proc/{pid}/cmdline", "rb").read() == me:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
