"""Soak: kill and pause random workers of running groups; time detection and re-forming.

Run: python benchmarks/soak_faults.py --minutes 2 [--seed S] [--world-size 4] [--json]

(The seeded in-process soak of every membership fault, with the registry away too, is
tests/test_membership_hardening_soak.py: 211 runs in CI, and the 1,000-run version with
`DSML_SOAK_RUNS=1000 python -m pytest tests/test_membership_hardening_soak.py -q`.)

A `dsml registry` process serves generation after generation of groups of
`--world-size` workers (tests/scripts/loop_all_reduce.py: ring all_reduces of `--mib` MiB
in a loop, each result checked for exactness by the worker). Into each generation, one
at a time, random faults are injected until two workers are left; then the generation is
stopped (every survivor must end cleanly) and the next one starts. The faults:

- kill:       SIGKILL of a random worker at a random moment. Measured: detection (kill
              to PeerLostError on a survivor) and re-form (kill to a survivor's first
              exact call in the new view), both per survivor.
- pause:      SIGSTOP shorter than half the heartbeat timeout, then SIGCONT. Expected: no
              loss anywhere; measured: the stall (SIGCONT to every worker's next call).
- evict:      SIGSTOP longer than the heartbeat timeout. Measured: eviction (SIGSTOP to
              the survivors' PeerLostError, about the timeout); after SIGCONT the worker
              must fail with EvictedError and exit.
- registry:   SIGKILL of the registry, restarted on the same address after a random
              outage (up to 1.5 timeouts). Expected: no loss, calls go on meanwhile.
- kill2:      SIGKILL of two workers at once (with four or more left). Measured as kill.
- outage_kill: SIGKILL of the registry, then of a worker; the registry restarts 0.5 to
              1.5 s later. Measured: restart to the survivors' first call without it.

A kill whose survivors need more than 1 s (DESIGN.md section 4: "about a second") to run
a call in their new view counts as `slow_reform`.

A fault whose expected outcome does not come within its deadline is a hang: the
generation's logs are printed and it is abandoned (its processes killed). Also counted:
inexact results, unexpected losses, unexpected errors, unclean exits. Expected all 0.
The seed picks the schedule (which fault, which worker, when); the interleaving with the
processes is still up to the machine. A benchmark: it reports and asserts nothing, but
exits 1 if anything unexpected was counted.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOOP = ROOT / "tests" / "scripts" / "loop_all_reduce.py"
DSML = [sys.executable, "-m", "dsml"]

Event = dict[str, Any]


class Hang(Exception):
    """An expected outcome did not come within its deadline."""


class Worker:
    def __init__(self, index: int, proc: subprocess.Popen[str], cond: threading.Condition):
        self.index = index
        self.proc = proc
        self.events: list[Event] = []
        self.cond = cond
        self.gone = False  # killed or evicted by the soak
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "garbage", "line": line, "t": time.time()}
            with self.cond:
                self.events.append(event)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def of(self, kind: str, after: float = 0.0) -> list[Event]:
        return [e for e in list(self.events) if e["event"] == kind and e["t"] >= after]

    def alive(self) -> bool:
        return not self.gone and self.proc.poll() is None

    def tail(self) -> str:
        return "\n".join(f"  w{self.index}: {json.dumps(e)}" for e in self.events[-6:])


class Soak:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.rng = random.Random(args.seed)
        self.cond = threading.Condition()
        self.registry: subprocess.Popen[str] | None = None
        self.address = "tcp://127.0.0.1:0"
        self.workers: list[Worker] = []
        self.generation = 0
        self.times: dict[str, list[float]] = {
            "kill_detect": [],
            "kill_seen": [],
            "kill_reform": [],
            "kill2_detect": [],
            "kill2_seen": [],
            "kill2_reform": [],
            "outage_kill_reform": [],
            "evict_detect": [],
            "evict_reform": [],
            "evicted_exit": [],
            "pause_stall": [],
            "registry_outage": [],
        }
        self.counts: Counter[str] = Counter()

    # -- processes ------------------------------------------------------------------------

    def start_registry(self) -> None:
        hb = ["--heartbeat-interval", str(self.args.hb_interval)]
        hb += ["--heartbeat-timeout", str(self.args.hb_timeout)]
        self.registry = subprocess.Popen(
            [*DSML, "registry", "--address", self.address, *hb],
            stdout=subprocess.PIPE,
            stderr=(self.tmp / "registry.err").open("a"),
            text=True,
            cwd=ROOT,
        )
        assert self.registry.stdout is not None
        line = self.registry.stdout.readline()
        if not line.startswith("dsml registry serving on "):
            raise RuntimeError(f"the registry did not start: {line!r}")
        self.address = line.split()[4]

    def kill_registry(self) -> None:
        assert self.registry is not None
        self.registry.kill()
        self.registry.wait(timeout=10)
        if self.registry.stdout is not None:
            self.registry.stdout.close()
        self.registry = None

    def start_generation(self) -> None:
        self.generation += 1
        self.stop_file = self.tmp / f"stop{self.generation}"
        a = self.args
        self.workers = []
        for index in range(a.world_size):
            cmd = [sys.executable, str(LOOP), "--registry", self.address]
            cmd += ["--world-size", str(a.world_size), "--stop-file", str(self.stop_file)]
            cmd += ["--mib", str(a.mib), "--pause", str(a.pause), "--max-seconds", "600"]
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=(self.tmp / f"g{self.generation}w{index}.err").open("w"),
                text=True,
                cwd=ROOT,
            )
            self.workers.append(Worker(index, proc, self.cond))
        self.wait(lambda: all(len(w.of("ok")) >= 2 for w in self.workers), "the group formed", 60)

    def end_generation(self) -> None:
        self.stop_file.touch()
        deadline = time.monotonic() + 20
        for w in self.workers:
            if w.gone:
                continue
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise Hang(f"worker {w.index} did not stop") from None
            w.thread.join(timeout=5)
            if w.proc.returncode != 0 or not w.of("done"):
                self.counts["unclean_exit"] += 1
                self.report_problem(f"worker {w.index} exited with {w.proc.returncode}")
        self.account()
        self.workers = []

    def abandon_generation(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
                w.proc.kill()
            w.proc.wait(timeout=10)
        self.account()
        self.workers = []
        if self.registry is not None:  # a fresh registry: the old one may keep a dead group
            self.kill_registry()
        self.start_registry()

    def account(self) -> None:
        for w in self.workers:
            self.counts["calls"] += len(w.of("ok"))
            self.counts["inexact"] += sum(1 for e in w.of("ok") if not e["exact"])
            self.counts["errors"] += len(w.of("error")) + len(w.of("garbage"))

    def close(self) -> None:
        if self.workers:
            self.abandon_generation()
        if self.registry is not None and self.registry.poll() is None:
            self.registry.send_signal(signal.SIGTERM)
            try:
                self.registry.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.registry.kill()
                self.registry.communicate(timeout=10)

    # -- waiting --------------------------------------------------------------------------

    def wait(self, predicate: Any, what: str, within: float) -> None:
        deadline = time.monotonic() + within
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Hang(f"not within {within:g} s: {what}")
                self.cond.wait(min(left, 0.2))

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.alive()]

    def report_problem(self, what: str) -> None:
        print(f"!! generation {self.generation}: {what}", flush=True)
        for w in self.workers:
            print(w.tail(), flush=True)

    # -- faults ---------------------------------------------------------------------------

    def fault_kill(self, count: int = 1) -> str:
        victims = self.rng.sample(self.live(), count)
        survivors = [w for w in self.live() if w not in victims]
        epoch = max(e["epoch"] for w in survivors for e in w.of("ok")[-1:])
        killed = time.time()
        for victim in victims:
            victim.proc.kill()
            victim.gone = True
        name = "kill" if count == 1 else f"kill{count}"

        def reformed(w: Worker) -> bool:
            return any(e["size"] == len(survivors) for e in w.of("ok", killed))

        self.wait(lambda: all(w.of("lost", killed) for w in survivors), "PeerLostError", 10)
        self.wait(lambda: all(reformed(w) for w in survivors), "a call in the new view", 15)
        for w in survivors:
            self.times[f"{name}_detect"].append(w.of("lost", killed)[0]["t"] - killed)
            seen = w.of("disconnect", killed)
            if seen:
                self.times[f"{name}_seen"].append(seen[0]["t"] - killed)
            first = next(e for e in w.of("ok", killed) if e["size"] == len(survivors))
            self.times[f"{name}_reform"].append(first["t"] - killed)
            if first["epoch"] <= epoch:
                self.counts["wrong_epoch"] += 1
            if first["t"] - killed > REFORM_TARGET_S:
                self.counts["slow_reform"] += 1
                self.report_problem(f"{name}: re-formed after {first['t'] - killed:.2f} s")
        for victim in victims:
            victim.proc.wait(timeout=10)
        self.settle(survivors, killed, once=count == 1)
        return f"{name} {' '.join(f'w{v.index}' for v in victims)}"

    def fault_kill2(self) -> str:
        return self.fault_kill(2) if len(self.live()) >= 4 else self.fault_kill(1)

    def fault_outage_kill(self) -> str:
        """A worker dies while the registry is down; the registry comes back."""
        victim = self.rng.choice(self.live())
        survivors = [w for w in self.live() if w is not victim]
        outage = self.rng.uniform(0.5, 1.5)
        down = time.time()
        self.kill_registry()
        time.sleep(0.2)
        victim.proc.kill()
        victim.gone = True
        time.sleep(outage)
        self.start_registry()
        up = time.time()

        def reformed(w: Worker) -> bool:
            return any(e["size"] == len(survivors) for e in w.of("ok", up))

        within = self.args.hb_timeout + 10
        self.wait(lambda: all(reformed(w) for w in survivors), "a view after restart", within)
        for w in survivors:
            first = next(e for e in w.of("ok", up) if e["size"] == len(survivors))
            self.times["outage_kill_reform"].append(first["t"] - up)
            if first["t"] - up > self.args.hb_timeout + 2.0:
                self.counts["slow_reform"] += 1
                self.report_problem(f"outage kill: re-formed {first['t'] - up:.2f} s after up")
        victim.proc.wait(timeout=10)
        self.settle(survivors, down, once=False)
        return f"outage_kill w{victim.index} registry down {up - down:.2f}s"

    def fault_pause(self) -> str:
        victim = self.rng.choice(self.live())
        length = self.rng.uniform(0.05, self.args.hb_timeout / 2)
        stopped = time.time()
        victim.proc.send_signal(signal.SIGSTOP)
        time.sleep(length)
        victim.proc.send_signal(signal.SIGCONT)
        resumed = time.time()
        live = self.live()
        self.wait(lambda: all(w.of("ok", resumed) for w in live), "calls after SIGCONT", 10)
        self.times["pause_stall"].append(max(w.of("ok", resumed)[0]["t"] for w in live) - resumed)
        if any(w.of("lost", stopped) or w.of("evicted", stopped) for w in live):
            self.counts["false_eviction"] += 1
            self.report_problem(f"a pause of {length:.2f} s evicted someone")
        return f"pause w{victim.index} {length:.2f}s"

    def fault_evict(self) -> str:
        victim = self.rng.choice(self.live())
        survivors = [w for w in self.live() if w is not victim]
        epoch = max(e["epoch"] for w in survivors for e in w.of("ok")[-1:])
        timeout = self.args.hb_timeout
        length = self.rng.uniform(timeout + 0.5, timeout + 2.0)
        stopped = time.time()
        victim.proc.send_signal(signal.SIGSTOP)

        def reformed(w: Worker) -> bool:
            return any(e["epoch"] > epoch for e in w.of("ok", stopped))

        try:
            self.wait(lambda: all(reformed(w) for w in survivors), "eviction", timeout + 10)
        finally:
            time.sleep(max(0.0, stopped + length - time.time()))
            victim.proc.send_signal(signal.SIGCONT)
        resumed = time.time()
        victim.gone = True
        try:
            victim.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            raise Hang("the evicted worker did not end after SIGCONT") from None
        self.times["evicted_exit"].append(time.time() - resumed)
        if victim.proc.returncode != 3 or not victim.of("evicted"):
            self.counts["not_evicted_error"] += 1
            self.report_problem(f"evicted worker exited {victim.proc.returncode}")
        for w in survivors:
            lost = w.of("lost", stopped)
            if lost:
                self.times["evict_detect"].append(lost[0]["t"] - stopped)
            first = next(e for e in w.of("ok", stopped) if e["epoch"] > epoch)
            self.times["evict_reform"].append(first["t"] - stopped)
        self.settle(survivors, stopped)
        return f"evict w{victim.index} {length:.2f}s"

    def fault_registry(self) -> str:
        live = self.live()
        outage = self.rng.uniform(0.2, 1.5 * self.args.hb_timeout)
        down = time.time()
        self.kill_registry()
        time.sleep(outage)
        self.start_registry()
        up = time.time()
        self.wait(lambda: all(w.of("ok", up + 0.5) for w in live), "calls after the restart", 10)
        self.times["registry_outage"].append(outage)
        self.counts["calls_while_registry_down"] += sum(
            1 for w in live for e in w.of("ok", down) if e["t"] < up
        )
        # past the restarted registry's grace: nobody may be evicted for the outage
        time.sleep(max(0.0, up + self.args.hb_timeout + 0.5 - time.time()))
        if any(w.of("lost", down) or w.of("evicted", down) for w in live):
            self.counts["lost_to_registry_restart"] += 1
            self.report_problem("a registry restart cost a member")
        return f"registry down {outage:.2f}s"

    def settle(self, survivors: list[Worker], since: float, once: bool = True) -> None:
        """Count survivors that saw one loss more than once (exactly once is the rule)."""
        self.wait(lambda: all(len(w.of("ok", since)) >= 2 for w in survivors), "calls", 10)
        for w in survivors:
            if once and len(w.of("lost", since)) > 1:
                self.counts["lost_twice"] += 1
                self.report_problem(f"worker {w.index} saw one loss twice")

    # -- the soak -------------------------------------------------------------------------

    def run(self) -> None:
        end = time.monotonic() + self.args.minutes * 60
        kinds = ["kill", "kill2", "pause", "evict", "registry", "outage_kill"]
        weights = [0.35, 0.1, 0.2, 0.15, 0.1, 0.1]
        self.start_registry()
        print(f"registry {self.address}", flush=True)
        while time.monotonic() < end:
            try:
                self.start_generation()
                print(f"generation {self.generation}: {len(self.workers)} workers", flush=True)
                while len(self.live()) > 2 and time.monotonic() < end:
                    time.sleep(self.rng.uniform(0.1, 1.0))
                    kind = self.rng.choices(kinds, weights)[0]
                    started = time.monotonic()
                    what = getattr(self, f"fault_{kind}")()
                    self.counts[what.split()[0]] += 1
                    took = time.monotonic() - started
                    print(f"  {what}: handled in {took:.2f} s", flush=True)
                self.end_generation()
            except Hang as exc:
                self.counts["hangs"] += 1
                self.report_problem(f"HANG: {exc}")
                self.abandon_generation()

    def summary(self) -> dict[str, Any]:
        times = {
            name: {
                "n": len(v),
                "median_s": round(statistics.median(v), 3),
                "max_s": round(max(v), 3),
            }
            for name, v in self.times.items()
            if v
        }
        return {
            "seed": self.args.seed,
            "generations": self.generation,
            "counts": dict(self.counts),
            "times": times,
        }


PROBLEMS = (
    "hangs",
    "inexact",
    "errors",
    "unclean_exit",
    "false_eviction",
    "not_evicted_error",
    "lost_to_registry_restart",
    "lost_twice",
    "wrong_epoch",
    "slow_reform",
)
REFORM_TARGET_S = 1.0  # DESIGN.md section 4: about a second after a kill -9

LABELS = {
    "kill_seen": "kill -> connection drop seen by a survivor",
    "kill_detect": "kill -> PeerLostError on a survivor",
    "kill_reform": "kill -> first exact call in the new view",
    "kill2_seen": "kill of 2 at once -> connection drop seen",
    "kill2_detect": "kill of 2 at once -> PeerLostError",
    "kill2_reform": "kill of 2 at once -> first exact call without them",
    "outage_kill_reform": "kill while registry down: restart -> first call",
    "evict_detect": "SIGSTOP -> PeerLostError (eviction)",
    "evict_reform": "SIGSTOP -> first exact call without it",
    "evicted_exit": "SIGCONT -> evicted worker ended (EvictedError)",
    "pause_stall": "SIGCONT -> every worker's next call (short pause)",
    "registry_outage": "registry outage (chosen)",
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--mib", type=float, default=8.0)
    p.add_argument("--pause", type=float, default=0.02, help="seconds between a worker's calls")
    p.add_argument("--hb-interval", type=float, default=0.2)
    p.add_argument("--hb-timeout", type=float, default=2.0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    print(
        f"# soak_faults: seed={args.seed} minutes={args.minutes:g} world_size="
        f"{args.world_size} mib={args.mib:g} heartbeats {args.hb_interval:g}/"
        f"{args.hb_timeout:g} s",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="dsml-soak-") as tmp:
        soak = Soak(args, Path(tmp))
        try:
            soak.run()
        finally:
            soak.close()
    result = soak.summary()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"# seed {result['seed']}: {result['generations']} generations, "
            f"{soak.counts['calls']} calls"
        )
        print(
            "# faults: "
            + ", ".join(
                f"{k} {soak.counts[k]}"
                for k in ("kill", "kill2", "pause", "evict", "registry", "outage_kill")
            )
        )
        for name, row in result["times"].items():
            print(
                f"{LABELS[name]:<54} n={row['n']:<3} median {row['median_s']:.3f} s  "
                f"max {row['max_s']:.3f} s"
            )
        print("# unexpected: " + ", ".join(f"{k} {soak.counts[k]}" for k in PROBLEMS))
        print(
            f"# calls completed while the registry was down: "
            f"{soak.counts['calls_while_registry_down']}"
        )
    return 1 if any(soak.counts[k] for k in PROBLEMS) else 0


if __name__ == "__main__":
    sys.exit(main())
