"""The job config: one pydantic model per service, loaded from YAML with dotted `--set` overrides."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config problem, reported as one line that names the offending key."""


class WarmStartError(RuntimeError):
    """The warm start could not land the base model in `model.warm_start.target_band`; nothing was cached."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class WarmStartConfig(Strict):
    """Supervised warm start that turns a random init into a base model RL can improve.

    With a `target_band`, the pass stops by accuracy: every `eval_every` steps it scores greedy accuracy on the
    tasks' probe sets (disjoint from training and from the held-out sets RL is scored on) and stops at the first
    evaluation inside the band. Accuracy can jump past the band between two evaluations (the digit algorithm is
    found suddenly): then the pass rolls back to the last evaluation and replays those steps, which are
    deterministic, evaluating every step, and stops at the first step inside the band. If no step of the replay
    lands in the band, or `max_steps` pass first, the build fails: RL never gets a base outside the band."""

    max_steps: int = Field(9000, ge=0, description="cap on SFT optimizer steps; the lr schedule (5% linear "
                           "warm-up, then a cosine to 10% of `lr`) spans max_steps wherever the pass stops")
    target_band: tuple[float, float] | None = Field(
        (0.40, 0.55), description="stop at the first probe evaluation whose greedy accuracy (mean over `tasks`) is "
        "in [low, high]; None: no probe, run all max_steps (a fixed recipe)")
    eval_every: int = Field(100, ge=1, description="SFT steps between probe evaluations")
    probe_problems: int = Field(400, ge=1, description="probe problems per task (about 2.5 points of noise at "
                                "400 and 50%)")
    seed: int = Field(0, description="seed for init, data and order: the base model is a pure function of config "
                      "and of the machine's float kernels, which the target band makes harmless")
    batch_size: int = Field(64, ge=1, description="sequences per SFT step")
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate for SFT")
    tasks: list[str] = Field(["arithmetic"], min_length=1, description="tasks whose data the SFT pass sees")
    init_from: WarmStartConfig | None = Field(
        None, description="start from the base model this earlier warm start builds (cached on its own, e.g. the "
        "default job's) instead of a random init; None: random init")

    @model_validator(mode="after")
    def _band(self) -> WarmStartConfig:
        if self.target_band is not None:
            low, high = self.target_band
            if not 0 <= low < high <= 1:
                raise ValueError(f"model.warm_start.target_band must be (low, high) with 0 <= low < high <= 1, "
                                 f"got {self.target_band}")
        return self


class ModelConfig(Strict):
    """The policy: an HF-format directory, or the tiny built-in model that `jetroll init-model` builds."""

    path: str | None = Field(None, description="HF-format model dir; None builds/uses the cached tiny model")
    cache_dir: str = Field("~/.cache/jetroll", description="where the tiny base model is cached")
    hidden_size: int = Field(128, ge=128, multiple_of=128, description="tiny model width")
    num_layers: int = Field(4, ge=1, description="tiny model decoder layers")
    num_heads: int = Field(2, ge=1, description="attention (query) heads")
    num_kv_heads: int = Field(1, ge=1, description="key/value heads (GQA)")
    intermediate_size: int = Field(384, ge=128, multiple_of=128, description="SwiGLU hidden width")
    max_position_embeddings: int = Field(4096, ge=2304, description="context length")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base")
    tie_word_embeddings: bool = Field(True, description="share the embedding and lm_head weights")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("model.hidden_size must be divisible by model.num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.num_heads must be divisible by model.num_kv_heads")
        return self


class TaskWeight(Strict):
    name: str = Field(description="a registered task name (see jetroll.shared.tasks.registry.TASKS)")
    weight: float = Field(1.0, gt=0, description="relative sampling weight in the task mix")


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
    accelerator_type: str | None = Field(None, description="resource hint: Ray accelerator_type, e.g. H200")
    timing: TimingEngineConfig | None = Field(None, description="rollout.engine timing: this pool's hardware speed; "
                                              "None uses rollout.timing")

    @model_validator(mode="after")
    def _max_workers(self) -> PoolConfig:
        if self.max_workers is not None and self.max_workers < self.num_workers:
            raise ValueError(f"pool {self.name}: max_workers {self.max_workers} < num_workers {self.num_workers}")
        return self


class RolloutConfig(Strict):
    """Rollout workers: a continuous-batching engine per worker, grouped into pools."""

    engine: Literal["real", "timing"] = Field("real", description="real: the model decodes; timing: the timing "
                                              "model (rollout.timing) stands in for it, for orchestration benchmarks")
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
    recompute_kv_on_swap: bool = Field(True, description="recompute in-flight KV caches after a weight swap")
    compile: bool = Field(True, description="torch.compile the decode step (tens of seconds once per worker)")
    threads: int = Field(1, ge=1, description="torch threads per worker")
    env_timeout_s: float = Field(10.0, gt=0, description="multi-turn tasks: limit on each environment reset or "
                                 "step attempt")
    env_max_retries: int = Field(1, ge=0, description="multi-turn tasks: retries of a reset or step that timed out "
                                 "or raised; still failing, the trajectory ends with that env_status (env_fail)")

    @model_validator(mode="after")
    def _unique_pools(self) -> RolloutConfig:
        names = [pool.name for pool in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"rollout.pools: duplicate pool names in {names}")
        listed = [task for pool in self.pools for task in pool.tasks]
        if len(set(listed)) != len(listed):
            raise ValueError(f"rollout.pools: a task is routed explicitly to two pools: {listed}")
        return self

    def sample_budget(self, task_max_new_tokens: int) -> int:
        """Tokens a training sample of a task asking for `task_max_new_tokens` may generate."""
        return min(task_max_new_tokens, self.max_new_tokens)

    def pool(self, name: str) -> PoolConfig:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise ValueError(f"unknown rollout pool {name!r}; pools: {[p.name for p in self.pools]}")


class RewardConfig(Strict):
    """The reward router: scores each task's reward on a backend (local pool, Celery or AWS Lambda) and owns
    retries: throttling with backoff, a timeout or error `max_retries` times on local and celery, never on lambda."""

    backend: Literal["local", "celery", "lambda"] = Field("local", description="backend of every task not in "
                                                          "task_backends")
    task_backends: dict[str, Literal["local", "celery", "lambda"]] = Field(
        default_factory=dict, description="per-task backend overrides, e.g. {code: lambda}")
    modules: list[str] = Field(default_factory=list, description="extra modules whose @reward functions the local "
                               "pool and a launched Celery worker import (remote runners: JETROLL_REWARD_MODULES)")
    num_workers: int = Field(1, ge=1, description="local backend: pool processes (its concurrency limit)")
    timeout_s: float = Field(10.0, gt=0, description="per-call limit: local kills the worker, celery's soft time "
                             "limit, lambda's function timeout")
    max_retries: int = Field(1, ge=0, description="retries of a timeout or error on local and celery; lambda "
                             "never retries them (the handler may have run)")
    max_throttle_retries: int = Field(5, ge=0, description="retries of a throttled call (429) before `throttled` "
                                      "is final")
    throttle_backoff_s: float = Field(0.2, gt=0, description="first backoff after a throttle; doubles, with jitter")
    celery_broker_url: str | None = Field(None, description="Celery Redis broker; None uses the job's Redis")
    celery_queue: str = Field("jetroll.reward", min_length=1, description="Celery queue of reward tasks")
    celery_concurrency: int = Field(4, ge=1, description="celery: tasks in flight, and the launched worker's "
                                    "prefork processes")
    celery_hard_grace_s: float = Field(5.0, gt=0, description="celery hard time limit = timeout_s + this")
    celery_visibility_timeout_s: float = Field(300.0, gt=0, description="broker redelivers a task unacked this "
                                               "long (its worker died); must exceed the hard limit")
    celery_start_worker: bool = Field(True, description="`jetroll run` starts a Celery worker when a task uses "
                                      "celery (false: bring your own on celery_broker_url)")
    lambda_function: str = Field("jetroll-reward", min_length=1, description="Lambda function for rewards not in "
                                 "lambda_functions")
    lambda_functions: dict[str, str] = Field(default_factory=dict, description="reward name -> function name/ARN")
    lambda_endpoint_url: str | None = Field(None, description="Lambda API endpoint (local server); None is AWS")
    lambda_region: str = Field("us-east-1", description="AWS region of the functions")
    lambda_concurrency: int = Field(32, ge=1, description="lambda: invocations in flight")
    lambda_read_timeout_s: float | None = Field(None, gt=0, description="HTTP read timeout; None is timeout_s + "
                                                "10. Above the function timeout, so a client timeout never "
                                                "re-runs a handler")
    threads: int = Field(1, ge=1, description="torch threads for the router process")

    @model_validator(mode="after")
    def _limits(self) -> RewardConfig:
        from jetroll.shared.tasks.registry import TASKS

        for task in self.task_backends:
            if task not in TASKS:
                raise ValueError(f"reward.task_backends: unknown task {task!r}; valid: {sorted(TASKS)}")
        if self.celery_visibility_timeout_s <= self.celery_hard_time_limit_s:
            raise ValueError("reward.celery_visibility_timeout_s must exceed reward.timeout_s + "
                             f"reward.celery_hard_grace_s ({self.celery_hard_time_limit_s}s)")
        if self.lambda_read_timeout_s is not None and self.lambda_read_timeout_s <= self.timeout_s:
            raise ValueError("reward.lambda_read_timeout_s must exceed reward.timeout_s (the function timeout)")
        return self

    @property
    def celery_hard_time_limit_s(self) -> float:
        return self.timeout_s + self.celery_hard_grace_s

    @property
    def lambda_read_s(self) -> float:
        return self.lambda_read_timeout_s if self.lambda_read_timeout_s is not None else self.timeout_s + 10.0

    def backend_of(self, task: str) -> str:
        """The backend that scores `task`."""
        return self.task_backends.get(task, self.backend)


class TrainerConfig(Strict):
    """Decoupled PPO with GRPO advantages on fp32 master weights."""

    max_steps: int = Field(60, ge=1, description="optimizer steps; one weight version each")
    groups_per_step: int = Field(16, ge=1, description="B: groups per optimizer step")
    group_size: int = Field(8, ge=1, description="samples per prompt (GRPO group)")
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate (the peak, under a cosine schedule)")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="cosine: decay from `lr` at step 0 to lr x lr_final_ratio at max_steps; annealing "
        "averages out the sampling noise of the last updates")
    lr_final_ratio: float = Field(0.0, ge=0, le=1, description="cosine: the final lr as a fraction of `lr`")
    lr_decay_frac: float = Field(1.0, gt=0, le=1, description="cosine: the decay spans this last fraction of "
                                 "max_steps; before it the lr holds at `lr` (stable, then decay)")
    warmup_steps: int = Field(0, ge=0, description="linear lr warm-up over the first steps, in either schedule: "
                              "Adam's first updates move every weight by about lr whatever its gradient's size; a "
                              "cosine decay starts after it at the latest")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="global grad-norm clip")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip, low side")
    clip_eps_high: float = Field(0.28, gt=0, description="PPO ratio clip, high side")
    dual_clip_c: float = Field(3.0, gt=1, description="dual clip bound for negative advantages")
    advantage: Literal["grpo", "dr_grpo"] = Field(
        "grpo", description="grpo: (r - mean) / std per group, the loss over the batch's policy tokens; dr_grpo: "
        "r - mean, the loss over batch x max_new_tokens (each sample's generation budget: its task's max_new_tokens, "
        "capped by rollout.max_new_tokens)")
    kl_coef: float = Field(0.0, ge=0, description="KL to the reference (base) policy; 0 disables")
    task_quotas: bool = Field(True, description="each task gets its weight share of every step's groups and of the "
                              "admission window; a share a task leaves unused goes to the others' oldest groups")
    checkpoint_every: int = Field(20, ge=1, description="write a resumable checkpoint every K steps")
    threads: int = Field(1, ge=1, description="torch threads for the trainer")
    engine: Literal["real", "timing"] = Field("real", description="real: forward/backward and an optimizer step; "
                                              "timing: a sleep instead (weights unchanged), keeping the ledger, acks, "
                                              "metrics and weight publication (benchmarks)")
    timing_step_s: float = Field(1.0, gt=0, description="trainer.engine timing: modelled time of a step plus its "
                                 "weight publication; the sleep is what the last real publication leaves of it")


BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BlockLinear = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# linears that read the same input share one inference GEMM, so they share one format
FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PrecisionConfig(Strict):
    """One precision flow shared by rollout and the trainer's forward pass (see ARCHITECTURE.md).

    Embeddings, lm_head, norms, the attention softmax and the logits always stay fp32; the block linears
    (q, k, v, o, gate, up, down) run in the mode's format unless listed in `high_precision`.
    """

    mode: Literal["fp32", "bf16", "fp8_unified", "fp8_rollout_only"] = Field(
        "fp32", description="fp32 (reference); bf16; fp8_unified (rollout and the trainer's forward share one FP8 "
        "flow); fp8_rollout_only (the failing baseline: FP8 rollout, bf16 trainer)")
    backend: Literal["fast", "exact"] = Field(
        "fast", description="CPU backend of no-grad passes: fast (fake-quant + fp32 GEMM, compiled decode) or exact "
        "(bitwise batch-invariant reference: decode and the trainer's log-probs agree to the bit; several x slower)")
    backward: Literal["fp8", "bf16"] = Field(
        "fp8", description="FP8 linears' backward GEMMs: fp8 (DGrad = Q1x128(dY) W, WGrad = Q1x128(dY^T) Q128x1(X)) "
        "or bf16 (dY and the operands rounded to bf16)")
    fmt: Literal["e4m3"] = Field("e4m3", description="FP8 format (max 448, round to nearest even)")
    weight_block: int = Field(128, ge=1, description="weight quantization block (square), as weight_block_size")
    act_group: int = Field(128, ge=1, description="activation quantization group along K; divides weight_block")
    scale_rounding: Literal["none", "pow2"] = Field(
        "none", description="round scales up to a power of two (ue8m0 scales, as DeepSeek-V3.1)")
    high_precision: list[BlockLinear] = Field(
        default_factory=list, description=f"block linears kept in bf16 in the FP8 modes, from {list(BLOCK_LINEARS)}; "
        "q/k/v and gate/up go together")
    correction: Literal["decoupled", "none", "token_tis", "seq_mis", "icepop"] = Field(
        "decoupled", description="the loss's correction for the rollout/trainer gap r = pi_prox / mu (precision and "
        "staleness): decoupled (w = min(r, correction_cap), tokens with r outside decoupled_band masked), none "
        "(w = 1), token_tis (w = min(r, correction_cap)), seq_mis (w = the sequence's product of r; sequences above "
        "correction_cap masked), icepop (w = r; tokens with r outside icepop_band masked)")
    correction_cap: float = Field(2.0, gt=0, description="C: the cap of w in decoupled and token_tis, and the "
                                  "bound on seq_mis's sequence weight")
    decoupled_band: tuple[float, float] = Field((0.0, 10.0), description="decoupled keeps tokens with r in "
                                                "[low, high]")
    icepop_band: tuple[float, float] = Field((0.5, 2.0), description="icepop keeps tokens with r in [low, high]")

    @model_validator(mode="after")
    def _consistent(self) -> PrecisionConfig:
        if self.weight_block % self.act_group:
            raise ValueError(f"precision.act_group ({self.act_group}) must divide precision.weight_block "
                             f"({self.weight_block}): the GEMM sums per activation group")
        for group in FUSED_LINEARS:
            if len({name in self.high_precision for name in group}) > 1:
                raise ValueError(f"precision.high_precision must list all of {list(group)} or none of them")
        for name in ("decoupled_band", "icepop_band"):
            low, high = getattr(self, name)
            if not 0 <= low < high:
                raise ValueError(f"precision.{name} must be (low, high) with 0 <= low < high")
        return self

    @property
    def precision_id(self) -> str:
        """Hash of the numeric precision config (the loss's correction aside), stamped on every trajectory."""
        numeric = self.model_dump_json(exclude={"correction", "correction_cap", "decoupled_band", "icepop_band"})
        return hashlib.sha256(numeric.encode()).hexdigest()[:12]

    def linear_format(self, name: str) -> Literal["fp32", "bf16", "fp8"]:
        """The number format of block linear `name` on the rollout side, which is also the published format."""
        if self.mode in ("fp32", "bf16"):
            return self.mode
        return "bf16" if name in self.high_precision else "fp8"

    def trainer_side(self) -> PrecisionConfig:
        """The precision of the trainer's own passes: bf16 under fp8_rollout_only, else this config."""
        return self.model_copy(update={"mode": "bf16"}) if self.mode == "fp8_rollout_only" else self


class StalenessConfig(Strict):
    """The staleness bound (ARCHITECTURE.md, "Staleness and versions"): admission keeps groups within eta versions;
    the trainer waits for the oldest in-flight group rather than let it pass eta_hard = 2 eta, and masks (and counts)
    any token still beyond eta_hard."""

    mode: Literal["async", "sync"] = Field("async", description="sync is the barrier baseline (eta = 0)")
    max_staleness: int = Field(2, ge=0, description="eta: admit while admitted <= (v + eta + 1) * B")

    @property
    def eta(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness

    @property
    def eta_hard(self) -> int:
        """Largest token lag the trainer trains on; later tokens are masked and counted."""
        return 2 * self.eta


class StoreConfig(Strict):
    """Where weight versions and checkpoints live: a local directory, or S3 (any S3-compatible server)."""

    type: Literal["local", "s3"] = Field("local", description="weight store backend; a store.uri alone selects s3")
    root: str = Field(
        "", description="local store root, or the S3 store's cache of fetched files; empty means <run-dir>/store"
    )
    uri: str = Field("", description="s3://bucket/prefix for the S3 store; empty keeps the local directory")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); None means AWS")
    region: str | None = Field(None, description="S3 region; None means the AWS default chain (env, ~/.aws)")
    keep_last: int = Field(3, ge=1, description="retention: versions kept besides checkpoints")
    poll_interval_s: float = Field(
        5.0, gt=0, description="rollout workers also poll LATEST this often, in case a weights event is missed"
    )
    multipart_threshold_mib: int = Field(
        200, ge=5, description="S3: files this big or bigger upload as parallel 16 MiB multipart parts"
    )

    @model_validator(mode="before")
    @classmethod
    def _uri_selects_s3(cls, data: Any) -> Any:
        # `--set store.uri=s3://...` alone is enough; an explicit type is still checked against the uri below
        if isinstance(data, dict) and data.get("uri") and "type" not in data:
            return {**data, "type": "s3"}
        return data

    @model_validator(mode="after")
    def _uri_matches_type(self) -> StoreConfig:
        if self.type == "local" and self.uri:
            raise ValueError(f"store.type 'local' conflicts with store.uri {self.uri!r}; drop one of them")
        if self.type == "s3":
            bucket, _ = self.bucket_and_prefix
            is_bucket = (
                3 <= len(bucket) <= 63
                and bucket[0].isalnum()
                and bucket[-1].isalnum()
                and all(c.islower() or c.isdigit() or c in ".-" for c in bucket)
            )
            if not self.uri.startswith("s3://") or not is_bucket:
                raise ValueError(
                    f"store.uri must look like s3://bucket/prefix (bucket: 3-63 lowercase letters, "
                    f"digits, '.' or '-'), got {self.uri!r}"
                )
        return self

    @property
    def bucket_and_prefix(self) -> tuple[str, str]:
        bucket, _, prefix = self.uri.removeprefix("s3://").partition("/")
        return bucket, prefix.strip("/")


class RedisConfig(Strict):
    url: str | None = Field(None, description="Redis URL; None starts a private redis-server")
    max_deliveries: int = Field(5, ge=1, description="deliveries before an entry goes to the dlq")
    claim_idle_ms: int = Field(30000, ge=100, description="XAUTOCLAIM entries idle this long")
    max_lag: int = Field(2048, ge=1, description="backpressure: producers wait while consumer lag exceeds")
    ledger_keep_groups: int = Field(1024, ge=0, description="outcomes the ledger keeps of groups below its fully "
                                    "recorded prefix, for audits; older groups count only in its totals, which "
                                    "bounds its memory")


class EvalConfig(Strict):
    num_problems: int = Field(200, ge=1, description="held-out problems per task for greedy accuracy")
    every_steps: int = Field(0, ge=0, description="also evaluate every N steps (0: start and end only)")


class LaunchConfig(Strict):
    max_restarts: int = Field(3, ge=0, description="restarts of a dead service before the job fails")
    trainer_num_cpus: float = Field(1.0, ge=0, description="ray launcher: CPUs reserved for the trainer actor")
    trainer_num_gpus: float = Field(0.0, ge=0, description="ray launcher: GPUs reserved for the trainer actor")
    reward_num_cpus: float = Field(1.0, ge=0, description="ray launcher: CPUs reserved for the reward router actor")


class JobConfig(Strict):
    """A whole RL job. Every service reads the same validated config."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)

    job_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:8], description="namespaces streams")
    seed: int = Field(0, description="the job's seed: the controller's problem draws (one per admission index), "
                      "rollout's sampling (one stream per traj_id) and the trainer's torch RNG all derive from it; "
                      "the base model has its own, model.warm_start.seed")
    model: ModelConfig = Field(default_factory=ModelConfig)
    tasks: list[TaskWeight] = Field(default_factory=lambda: [TaskWeight(name="arithmetic")], min_length=1)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @model_validator(mode="after")
    def _known_tasks(self) -> JobConfig:
        from jetroll.shared.tasks.registry import TASKS

        for i, task in enumerate(self.tasks):
            if task.name not in TASKS:
                raise ValueError(f"tasks.{i}.name: unknown task {task.name!r}; valid: {sorted(TASKS)}")
        for pool in self.rollout.pools:
            if (pool.max_batch or self.rollout.max_batch) < self.trainer.group_size:
                raise ValueError(f"rollout.max_batch (or pool {pool.name}'s max_batch) must be >= "
                                 "trainer.group_size (a group decodes together)")
            for task in pool.tasks:
                if task not in TASKS:
                    raise ValueError(f"rollout pool {pool.name}: unknown task {task!r}; valid: {sorted(TASKS)}")
        return self


def _set_dotted(tree: dict[str, Any], dotted: str, raw: str) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is not a section")
    node[keys[-1]] = yaml.safe_load(raw)


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    return f"invalid config: {where}: {msg}" if where else f"invalid config: {msg}"


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> JobConfig:
    """Load YAML (or nothing, for defaults) and apply `a.b=c` overrides; raise ConfigError on any problem."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}".splitlines()[0]) from exc
        if not isinstance(tree, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), raw)
    return validate_config(tree)


def validate_config(tree: dict[str, Any]) -> JobConfig:
    try:
        return JobConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def config_to_json(config: JobConfig) -> str:
    return json.dumps(config.model_dump(mode="json"), sort_keys=True)
