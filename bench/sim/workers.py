"""Simulated workers: the engine's real scheduler and block manager, priced by a step-cost
profile instead of running a model, on a host whose cores they may share.

A worker computes one engine step at a time, back to back while it has work, exactly as
`AsyncEngine` does: `Scheduler.schedule()` picks the step (continuous batching, chunked
prefill within the token budget, latency-class priority, preemption), the profile prices it
(bench.engine_profile), and when the step's work is done `Scheduler.postprocess()` advances
it. Commands that arrive during a step (a remote request's admission) wait for its end, as
they wait for the engine thread. Tokens are dummies: every request runs to its output length
(the real runs' lengths), so EOS never ends one early.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import records
from bench.engine_profile import predict
from pdserve.control.load import WorkerLoad
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.free_cpus import LONG_STEP_TOKENS, WINDOW_S, threads_for
from pdserve.engine.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
    interactive_prompt_budget,
    step_budget,
)
from pdserve.engine.sequence import SeqMode, SeqStatus
from pdserve.engine.sequence import Sequence as Seq
from pdserve.engine.step_rates import StepRates
from pdserve.types import FinishReason, LatencyClass, SamplingParams
from prefill_svc.gate import GateQueue

PROFILE = Path(__file__).resolve().parents[2] / "docs/bench/cluster_sim/engine_profile.json"
CORUN = PROFILE.with_name("engine_corun.json")
PREFILL_STEP_TOKENS = 128  # a step with this many prompt tokens counts as a prefill step
MODEL_ID = "SmolLM2-135M-Instruct"
BLOCK_BYTES = 737_280  # one 16-token KV block of SmolLM2-135M in float32


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step at full speed of one core, from a bench.engine_profile fit."""

    coef: dict[str, float]

    @classmethod
    def load(cls, path: Path = PROFILE) -> StepCost:
        return cls(records.read_json(path)["coef"])

    def step_s(self, pieces: Sequence[tuple[int, int]]) -> float:
        """`pieces`: per scheduled sequence (context before, new tokens)."""
        return max(predict(self.coef, pieces), 1e-4)


@dataclass(frozen=True)
class SimRequest:
    rid: str
    arrival_s: float
    ids: tuple[int, ...]  # prompt token ids
    output_len: int
    latency_class: LatencyClass
    class_name: str = ""


# A decode step of this many rows or more is priced beside another core's work as the
# measured "decode b=8"; a one-row step as "decode b=1" (kind DECODE_ONE) where measured,
# those between by their rows, linearly.
CORUN_ROWS = 8
DECODE_ONE = "decode b=1"
DECODE_KINDS = ("decode", DECODE_ONE)  # a decode step's kinds in the co-run table


def load_corun(path: Path = CORUN) -> dict[tuple[str, str], float]:
    """(this step's kind, the kind computing on another core) -> slowdown, measured by
    `bench.engine_profile --corun` (kinds: "decode" for its batch of CORUN_ROWS, DECODE_ONE
    for one row where measured, "prefill"); {} where not measured."""
    if not records.exists(path):
        return {}
    out = {}
    for name, row in records.read_json(path)["corun"].items():
        mine, _, other = name.partition(" beside ")
        kind = mine if mine == DECODE_ONE else mine.split()[0]
        out[(kind, other)] = float(row["slowdown"])
    return out


def corun_slowdown(corun: dict[tuple[str, str], float], kind: str, rows: int,
                   other: str) -> float:
    """A step's slowdown while `other` computes on another core: a decode step's by its
    rows, between the one-row and the CORUN_ROWS measurements (the latter alone where the
    one-row step was not measured)."""
    many = corun.get((kind, other), 1.0)
    if kind != "decode" or rows >= CORUN_ROWS or (DECODE_ONE, other) not in corun:
        return many
    one = corun[(DECODE_ONE, other)]
    return one + (many - one) * (max(rows, 1) - 1) / (CORUN_ROWS - 1)


class Host:
    """Cores shared by the workers placed on it, as Linux's CFS shares them: a busy worker
    pinned to a core shares it with the other busy ones there in proportion to their weights
    (nice 0: 1024, nice 5: 335); an unpinned one's threads each go to the core with the least
    busy weight (the kernel's load balancing; two may share one).
    An unpinned worker with one thread advances by the CPU it gets, e, as one thread at e.
    One with several whose threads each have a core to themselves advances at its `speedup`
    (its speed on as many idle CPUs as it has threads over one CPU's); relative to that, its
    full speed. But where one of its threads shares a core (even with another of its own),
    every parallel region of a step waits at its barrier for the thread that got least: the
    step advances as one thread at that thread's share, and each thread, held at the
    barriers, uses only its part of that, the rest of its share going to the others on its
    core (`barrier`). The engine alone on a 2-vCPU Xeon computed a 1,146-token prompt beside
    two streaming decode workers in 12.7-13.3 s on two threads, as on one
    (docs/bench/placement_s75). With `barrier` off (the simulator before stop 77) it
    advanced as one thread at the sum of its shares up to one CPU and from there linearly
    to its speedup.
    One that adapts its threads (`--adapt-threads`, as `pdserve cluster up` starts its
    prefill workers from stop 75 on) sizes each step when it starts, as the engine does:
    for a step of a long prompt a thread per core the others leave free (at least one), by
    a moving average over `window_s` of the CPU the others took (pdserve.engine.free_cpus;
    0: the cores nothing computes on at that instant, as before stop 77), and one thread for
    any other step.
    One worker alone on its cores runs at full speed (the profile's, times its own factor),
    divided by `corun`'s slowdown while another core of the host computes (shared caches,
    memory bandwidth and, on a VM, execution units: two busy cores each run slower than
    one); a decode step's by its rows (`corun_slowdown`: one row, the most memory-bound
    step, is slowed most)."""

    def __init__(self, cores: int, corun: dict[tuple[str, str], float] | None = None, *,
                 window_s: float = WINDOW_S, barrier: bool = True):
        self.cores = cores
        self.corun = corun or {}
        self.window_s, self.barrier = window_s, barrier
        self.workers: list[SimWorker] = []
        self._cpu: dict[SimWorker, float] = {}  # the CPU each busy worker gets now
        self._since = 0.0

    def advance(self, now: float) -> None:
        """Bring each adapting worker's moving average of the CPU the others take up to
        `now`, from what they took since the last call (constant in between)."""
        dt, self._since = now - self._since, now
        if dt <= 0.0 or self.window_s <= 0.0:
            return
        keep = math.exp(-dt / self.window_s)
        for w in self.workers:
            if w.adapt_threads:
                took = self.others_cpu(w)
                w.others_avg = took + (w.others_avg - took) * keep

    def others_cpu(self, w: SimWorker) -> float:
        """The CPU the host's other busy workers get now (as `speeds` last shared it)."""
        return min(float(self.cores), sum(c for x, c in self._cpu.items() if x is not w))

    def free_cores(self, w: SimWorker) -> float:
        """The cores `w` counts as free when it sizes a step (`FreeCpus.free`)."""
        if self.window_s <= 0.0:  # the instant's: cores nothing else computes on
            return float(self.cores - len({x.core for x in self.workers
                                           if x.busy and x is not w and x.core is not None}))
        return max(0.0, self.cores - w.others_avg)

    def size_step(self, w: SimWorker) -> int:
        """The threads adapting `w` runs its step on (`FreeCpus.threads`): a thread per
        free core for part of a long prompt, else one."""
        return threads_for(self.free_cores(w), w.threads) if w.step_long else 1

    def speeds(self) -> dict[SimWorker, float]:
        load = [0.0] * self.cores
        busy = [w for w in self.workers if w.busy]
        where: dict[SimWorker, list[int]] = {}
        for w in busy:
            if w.core is not None:
                where[w] = [w.core]
                load[w.core] += w.weight
        for w in busy:
            if w.core is None:
                where[w] = []
                n = w.step_threads
                if w.adapt_threads and self.window_s <= 0.0:  # before: resized at any change
                    n = self.size_step(w)
                for _ in range(n):
                    c = min(range(self.cores), key=lambda i: (load[i], i))
                    where[w].append(c)
                    load[c] += w.weight
        shares = {w: [w.weight / load[c] for c in cs] for w, cs in where.items()}
        # Held at its barriers, each thread of a step on several computes only its part
        # of what the slowest one can: the rest of its share goes to the core's others.
        held = {w: min(s) / len(s) for w, s in shares.items()
                if self.barrier and len(s) > 1 and min(s) < 1.0 - 1e-9}
        if held:
            spare = [0.0] * self.cores  # CPU a held thread leaves on its core
            weight = list(load)  # the weight of the threads that use all of their share
            for w, u in held.items():
                for c, x in zip(where[w], shares[w], strict=True):
                    spare[c] += x - u
                    weight[c] -= w.weight
            shares = {w: [held[w]] * len(s) if w in held else
                      [x + spare[c] * w.weight / weight[c] if weight[c] > 0 else x
                       for c, x in zip(where[w], s, strict=True)]
                      for w, s in shares.items()}
        self._cpu = {w: sum(s) for w, s in shares.items()}
        speeds = {w: w.parallel_speed(len(s) * held[w] if w in held else sum(s))
                  for w, s in shares.items()}
        if self.corun:
            for w, cs in where.items():
                # what computes on a core other than one of w's threads'
                others = {x.step_kind for x, ks in where.items() if x is not w
                          and any(k != c for k in ks for c in cs)}
                slow = max((corun_slowdown(self.corun, w.step_kind, w.step_rows, o)
                            for o in others), default=1.0)
                speeds[w] /= slow
        return speeds


class Clock:
    """What workers need from the event loop: the time and a way to be called back."""

    now: float

    def at(self, t: float, fn: Callable[[], object]) -> None:
        raise NotImplementedError


class SimWorker:
    """One worker's engine: steps, CPU share, measured rates (`StepRates`, as published)."""

    def __init__(self, worker_id: str, clock: Clock, cost: StepCost, host: Host, *,
                 core: int | None = None, threads: int = 1, speedup: float = 0.0,
                 adapt_threads: bool = False,
                 weight: float = 1024.0, num_blocks: int = 728,
                 block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_prefill_chunk: int = 512, max_num_seqs: int = 64,
                 step_target_ms: float = 0.0, interactive_step_target_ms: float = 0.0,
                 step_overhead_s: float = 0.0,
                 token_overhead_s: float = 0.0, context_overhead_s: float = 0.0):
        self.worker_id = worker_id
        self.clock, self.cost, self.host = clock, cost, host
        self.core, self.weight = core, weight
        self.threads = 1 if core is not None else max(1, threads)  # a pinned one: its core
        # its speed on `threads` idle CPUs over one CPU's (0: `threads`, perfect scaling)
        self.speedup = min(max(speedup or self.threads, 1.0), self.threads)
        # an unpinned one runs a thread per core the others leave free (EngineConfig)
        self.adapt_threads = adapt_threads
        self.step_threads = self.threads  # the current step's (`Host`)
        self.others_avg = 0.0  # an adapting one's average of the CPU others take (`Host`)
        self.step_overhead_s = step_overhead_s
        self.token_overhead_s = token_overhead_s
        self.context_overhead_s = context_overhead_s
        self.bm = BlockManager(num_blocks, block_size, hash_extra=MODEL_ID.encode(),
                               record_events=True)
        self.sched = Scheduler(EngineConfig(
            block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_chunk=max_prefill_chunk, step_target_ms=step_target_ms,
            interactive_step_target_ms=interactive_step_target_ms), self.bm)
        self.rates = StepRates()
        self.price_factor = 1.0  # the profile's price of a step, times this
        self.busy = False
        self.step_kind = "decode"
        self.step_rows = 0  # the current step's sequences
        self.step_long = False  # it computes part of a long prompt (free_cpus.LONG_STEP_TOKENS)
        self.steps = 0
        self._out: SchedulerOutput | None = None
        self._left = 0.0  # work (seconds at full speed) left in the current step
        self._work = 0.0  # the current step's work: the CPU seconds it gets (`StepRates`)
        self._speed = 1.0
        self._since = 0.0
        self._started = 0.0
        self._version = 0
        host.workers.append(self)

    def parallel_speed(self, cpus: float) -> float:
        """Its speed (1: its threads alone on their CPUs) when they get `cpus` CPUs
        together (`Host`)."""
        if self.threads == 1:
            return cpus
        more = (self.speedup - 1.0) * max(0.0, cpus - 1.0) / (self.threads - 1)
        return (min(cpus, 1.0) + more) / self.speedup

    # ------------------------------------------------------------------ stepping

    def kick(self) -> None:
        """Start the next step if idle and there is work."""
        if self.busy or not self.sched.has_work:
            return
        rate = self.rates.prefill_tokens_per_s
        out = self.sched.schedule(  # as LLMEngine.step sets it
            step_budget(self.sched.config, rate, len(self.sched.running)),
            interactive_prompt_budget(self.sched.config, rate))
        if not out.scheduled:
            return
        self._out = out
        streamed = sum(1 for s in out.scheduled if s.samples)
        prompt = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        self.step_kind = "prefill" if prompt >= PREFILL_STEP_TOKENS else "decode"
        self.step_rows = len(out.scheduled)
        self.step_long = any(s.seq.num_prompt_tokens >= LONG_STEP_TOKENS
                             for s in out.scheduled if s.start < s.seq.num_prompt_tokens)
        context = sum(s.start for s in out.scheduled if s.num_new_tokens == 1)
        self.host.advance(self.clock.now)
        self.step_threads = self.threads
        if self.adapt_threads:  # as LLMEngine sizes a step (pdserve.engine.free_cpus)
            self.step_threads = self.host.size_step(self)
        self._left = (self.step_overhead_s + self.token_overhead_s * streamed
                      + self.context_overhead_s * context
                      + self.price_factor * self.cost.step_s(
                          [(s.start, s.num_new_tokens) for s in out.scheduled]))
        self._work = self._left
        self._started = self._since = self.clock.now
        self.busy = True
        self._reshare()

    def _reshare(self) -> None:
        """Someone on the host started or stopped: bring every busy worker's progress up to
        now and reschedule its step's end at its new speed."""
        now = self.clock.now
        self.host.advance(now)
        speeds = self.host.speeds()
        for w in self.host.workers:
            if not w.busy:
                continue
            w._left -= w._speed * (now - w._since)
            w._since, w._speed = now, speeds[w]
            w._version += 1
            version = w._version
            w.clock.at(now + max(w._left, 0.0) / w._speed,
                       functools.partial(w._step_end, version))

    def _step_end(self, version: int) -> None:
        if version != self._version or not self.busy:
            return  # rescheduled since
        out, self._out = self._out, None
        assert out is not None
        self.busy = False
        self.steps += 1
        self._left = 0.0
        self.sched.postprocess(out)
        prefill_tokens = sum(s.num_new_tokens for s in out.scheduled
                             if s.start < s.seq.num_prompt_tokens)
        self.rates.observe(self.clock.now - self._started, prefill_tokens, self._work)
        sampled = [s.seq for s in out.scheduled
                   if s.start + s.num_new_tokens == s.seq.num_tokens]
        self.on_chunks([s for s in out.scheduled if s.start + s.num_new_tokens
                        < s.seq.num_prompt_tokens])
        self.on_step(sampled)
        self._reshare()
        self.kick()

    def on_step(self, sampled: list[Seq]) -> None:
        """`sampled`: the sequences whose step produced a token (their logits row)."""
        raise NotImplementedError

    def on_chunks(self, chunks: list[ScheduledSeq]) -> None:
        """`chunks`: the prompt chunks the step computed that are not a prompt's last."""

    def load(self) -> WorkerLoad:
        """The record its next heartbeat publishes."""
        raise NotImplementedError

    def base_load(self) -> WorkerLoad:
        return WorkerLoad(
            free_blocks=self.bm.num_free_blocks, total_blocks=self.bm.num_blocks,
            prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
            decode_step_s=self.rates.decode_step_s,
            prefill_cpu_share=self.rates.prefill_cpu_share,
            waiting_prompt_tokens=self.sched.waiting_prompt_tokens,
            engine_running=len(self.sched.running), engine_waiting=self.sched.num_waiting)


def _seq(req: SimRequest, now: float, mode: SeqMode = SeqMode.GENERATE,
         max_tokens: int | None = None) -> Seq:
    return Seq(req.rid, list(req.ids), SamplingParams(
        max_tokens=max_tokens or req.output_len, ignore_eos=True),
        latency_class=req.latency_class, mode=mode, arrival=now)


@dataclass
class Progress:
    """What the client sees of one request."""

    req: SimRequest
    route: str = ""
    decode: str = ""
    prefill: str = ""
    cached_tokens: int = 0  # prompt tokens served from the decode worker's prefix cache
    first_token_s: float | None = None
    finish_s: float | None = None
    tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    # A remote placement's decode step as cost placement priced it (when the worker had
    # measured it), and when its KV landed: its allocation + hand-off (router.calibration).
    priced_step_s: float | None = None
    landed_s: float | None = None


class DecodeSim(SimWorker):
    """A decode worker: local requests (prefilled here, chunked) and remote ones (blocks
    allocated, KV written from outside, admitted between steps with their first token)."""

    def __init__(self, *args: object, on_token: Callable[[str, float], None],
                 on_finish: Callable[[str, int], None],
                 on_step: Callable[[DecodeSim], None], **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.on_token, self.on_finish, self.after_step = on_token, on_finish, on_step
        self.seqs: dict[str, Seq] = {}
        self._admits: list[str] = []
        self.on_landed: Callable[[str, float], None] | None = None

    def add_local(self, req: SimRequest) -> Seq:
        seq = self.seqs[req.rid] = _seq(req, self.clock.now)
        self.sched.add(seq)
        self.kick()
        return seq

    def allocate_remote(self, req: SimRequest) -> Seq | None:
        """Blocks for a remote prefill, or None (the router prefills locally): pending
        transfers may hold at most half the pool, as decode_svc allows."""
        seq = _seq(req, self.clock.now)
        pending = sum(len(s.block_table) for s in self.sched.awaiting_kv.values())
        if pending + self.bm.blocks_needed(seq.num_tokens) > self.bm.num_blocks // 2:
            return None
        if not self.sched.allocate_remote(seq):
            return None
        self.seqs[req.rid] = seq
        return seq

    def awaits_kv(self, rid: str) -> bool:
        """`rid`'s blocks are reserved and its KV has not landed."""
        return rid in self.sched.awaiting_kv and rid not in self._admits

    def cancel_remote(self, rid: str) -> None:
        """Free the blocks reserved for `rid`'s KV (its lease ran out before the KV landed)."""
        seq = self.seqs.pop(rid)
        self.sched.finish(seq, FinishReason.ABORT)

    def kv_landed(self, rid: str) -> None:
        """The KV and the first token arrived: admitted at the engine's next command turn."""
        if self.on_landed is not None:
            self.on_landed(rid, self.clock.now)
        self._admits.append(rid)
        if not self.busy:
            self._admit_pending()
            self.kick()

    def _admit_pending(self) -> None:
        for rid in self._admits:
            seq = self.seqs[rid]
            self.sched.admit_remote(seq, 0)
            self._token(seq)
        self._admits.clear()
        self.after_step(self)

    def on_step(self, sampled: list[Seq]) -> None:
        for seq in sampled:
            seq.append_token(0)
            self._token(seq)
        self._admit_pending()
        self.after_step(self)

    def _token(self, seq: Seq) -> None:
        self.on_token(seq.request_id, self.clock.now)
        if seq.num_output_tokens >= seq.sampling.max_tokens:
            self.sched.finish(seq, FinishReason.LENGTH)
            del self.seqs[seq.request_id]
            self.on_finish(seq.request_id, seq.num_cached_tokens)

    def load(self) -> WorkerLoad:
        base = self.base_load()
        waiting = self.sched.num_waiting
        return dataclasses.replace(base, running=len(self.sched.running), waiting=waiting,
                                   awaiting_kv=len(self.sched.awaiting_kv),
                                   streams=len(self.seqs))


class PrefillSim(SimWorker):
    """A prefill worker: its prompts pass the real worker's gate (`prefill_svc.gate`: at most
    `max_inflight` in its engine or sending KV, one more per class that holds none while a
    worse one does, the rest by latency class, then arrival), each computed prefill-only at
    `prefill_factor` times the profile's price, then its KV sent to the decode worker
    (`transfer_s_per_token` of the part the decode worker lacks)."""

    def __init__(self, *args: object, transfer_s_per_token: float, max_inflight: int = 4,
                 prefill_factor: float = 1.0,
                 on_step: Callable[[PrefillSim], None] | None = None, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.after_step = on_step  # its cache changed: KV events to publish
        self.cached_tokens: dict[str, int] = {}  # request id -> prompt tokens its cache had
        self.transfer_s_per_token = transfer_s_per_token
        self.price_factor = prefill_factor
        self.gate: GateQueue[tuple[SimRequest, int, DecodeSim]] = GateQueue(max_inflight)
        self.queued_tokens = 0
        self.measured_transfer_s_per_token = 0.0
        self._jobs: dict[str, tuple[SimRequest, int, DecodeSim]] = {}
        self._seqs: dict[str, Seq] = {}  # in its engine
        self._dropped: set[str] = set()  # cancelled while computing or sending
        # request id -> when the KV of its latest chunk (a part) lands on the decode worker:
        # each part renews the decode worker's lease on its blocks (kvxfer.receiver: parts).
        self.part_landed_s: dict[str, float] = {}

    @property
    def active(self) -> int:
        return self.gate.active

    def submit(self, req: SimRequest, skip_tokens: int, decode: DecodeSim) -> None:
        """`skip_tokens`: the prompt's leading tokens the decode worker has cached."""
        if self.gate.try_enter(req.latency_class.priority, (req, skip_tokens, decode)):
            self._start(req, skip_tokens, decode)
        else:
            self.queued_tokens += len(req.ids)

    def _start(self, req: SimRequest, skip: int, decode: DecodeSim) -> None:
        self._jobs[req.rid] = (req, skip, decode)
        seq = self._seqs[req.rid] = _seq(req, self.clock.now, SeqMode.PREFILL_ONLY,
                                         max_tokens=1)
        self.sched.add(seq)
        self.kick()

    def cancel(self, rid: str) -> None:
        """The router gave `rid` up (its decode worker's lease ran out; `Simulation`): it
        leaves the gate's queue, or its engine after the step that runs it, or its KV is
        not delivered; its slot goes to the next waiter."""
        if (waiter := self.gate.remove_where(lambda w: w[0].rid == rid)) is not None:
            self.queued_tokens -= len(waiter[0].ids)
            return
        self._dropped.add(rid)
        self._try_abort(rid)

    def _try_abort(self, rid: str) -> None:
        """Abort `rid` in its engine, unless it is gone or the running step computes it (then
        `on_step` tries again after that step)."""
        if rid not in self._jobs or (self.busy and self._out is not None and any(
                s.seq.request_id == rid for s in self._out.scheduled)):
            return
        req, _, _ = self._jobs.pop(rid)
        self._dropped.discard(rid)
        self.part_landed_s.pop(rid, None)
        self.sched.finish(self._seqs.pop(rid), FinishReason.ABORT)
        self._leave(req)
        self.kick()

    def _leave(self, req: SimRequest) -> None:
        """`req` gives its gate slot back: the next waiters start."""
        for nreq, nskip, ndecode in self.gate.release(req.latency_class.priority):
            self.queued_tokens -= len(nreq.ids)
            self._start(nreq, nskip, ndecode)

    def on_chunks(self, chunks: list[ScheduledSeq]) -> None:
        """Each chunk's KV is sent as a part while the next one computes (the real worker's
        parts, at least `MIN_PART_BLOCKS` blocks; here every chunk)."""
        for s in chunks:
            rid = s.seq.request_id
            if rid in self._jobs and rid not in self._dropped:
                self.part_landed_s[rid] = (self.clock.now
                                           + s.num_new_tokens * self.transfer_s_per_token)

    def on_step(self, sampled: list[Seq]) -> None:
        done = {s.request_id for s in sampled}
        for rid in [r for r in self._dropped if r in self._jobs and r not in done]:
            # cancelled while its chunk computed: out once this step's turn is over
            self.clock.at(self.clock.now, functools.partial(self._try_abort, rid))
        for seq in sampled:
            seq.append_token(0)
            self.sched.finish(seq, FinishReason.LENGTH)  # held: its blocks are kept
            self.cached_tokens[seq.request_id] = seq.num_cached_tokens
            self._seqs.pop(seq.request_id, None)
            req, skip, decode = self._jobs.pop(seq.request_id)
            tokens = max(1, len(req.ids) - skip)
            seconds = tokens * self.transfer_s_per_token
            self.clock.at(self.clock.now + seconds,
                          functools.partial(self._sent, seq, req, decode, seconds, tokens))
        if self.after_step is not None:
            self.after_step(self)

    def _sent(self, seq: Seq, req: SimRequest, decode: DecodeSim, seconds: float,
              tokens: int) -> None:
        if seq.status is SeqStatus.HELD:
            self.sched.release(seq)
        rate, old = seconds / tokens, self.measured_transfer_s_per_token
        self.measured_transfer_s_per_token = rate if old == 0.0 else old + 0.2 * (rate - old)
        self._leave(req)
        self.part_landed_s.pop(req.rid, None)
        if req.rid in self._dropped:
            self._dropped.discard(req.rid)
        else:
            decode.kv_landed(req.rid)

    def load(self) -> WorkerLoad:
        base = self.base_load()
        return dataclasses.replace(base, running=self.active, queued=self.gate.num_waiting,
                                   queued_tokens=self.queued_tokens,
                                   kv_transfer_s_per_token=self.measured_transfer_s_per_token)
