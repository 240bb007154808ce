"""The job config: one section per service (each in its own module), loaded from YAML with dotted `--set`
overrides."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from jetroll.shared.config.launch import LaunchConfig, RedisConfig
from jetroll.shared.config.model import ModelConfig
from jetroll.shared.config.precision import PrecisionConfig
from jetroll.shared.config.reward import RewardConfig
from jetroll.shared.config.rollout import RolloutConfig
from jetroll.shared.config.staleness import StalenessConfig, eta_hard_of
from jetroll.shared.config.store import StoreConfig
from jetroll.shared.config.trainer import TrainerConfig
from jetroll.shared.errors import ConfigError
from jetroll.shared.schema import Strict
from jetroll.shared.tasks.agent import AgentTaskConfig
from jetroll.shared.tasks.base import Task
from jetroll.shared.tasks.dataset import DatasetTaskConfig
from jetroll.shared.tasks.entry import EnvFaults, TaskMixEntry
from jetroll.shared.tasks.env import is_multi_turn
from jetroll.shared.tasks.gym_text import GymTaskConfig
from jetroll.shared.tasks.reasoning import ReasoningGymTaskConfig
from jetroll.shared.tasks.registry import TASKS, Rewards, TaskSet


class RegisteredTaskConfig(TaskMixEntry):
    """A registered task in the mix (`kind: registered`, the default)."""

    kind: Literal["registered"] = Field("registered", description="a task jetroll registers by name (the default "
                                        "kind; `dataset`: a task read from files; `gymnasium`: an environment)")
    name: str = Field(description="a registered task name (see jetroll.shared.tasks.registry.TASKS)")
    env_faults: EnvFaults | None = Field(None, description="a multi-turn task's environment made slow and flaky on "
                                         "purpose: {delay_s, failure_rate}")


def _task_kind(entry: Any) -> str:
    return (entry.get("kind") if isinstance(entry, dict) else getattr(entry, "kind", None)) or "registered"


TaskEntry = Annotated[Annotated[RegisteredTaskConfig, Tag("registered")] | Annotated[DatasetTaskConfig, Tag("dataset")]
                      | Annotated[GymTaskConfig, Tag("gymnasium")]
                      | Annotated[ReasoningGymTaskConfig, Tag("reasoning_gym")]
                      | Annotated[AgentTaskConfig, Tag("agent")], Discriminator(_task_kind)]


class EvalConfig(Strict):
    num_problems: int = Field(200, ge=0, description="held-out problems per task for greedy accuracy; 0: no "
                              "held-out evaluation at all (summary.json's accuracies are null)")
    every_steps: int = Field(0, ge=0, description="also evaluate every N steps (0: start and end only)")


class MetricsConfig(Strict):
    sinks: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="where the controller writes metrics besides metrics.jsonl (always "
        "written): `tensorboard` (event files in <run-dir>/tensorboard; needs tensorboardX) and `wandb` (a run in "
        "<run-dir>/wandb; needs wandb), under the names of docs/metrics.md")
    wandb_project: str = Field("jetroll", min_length=1, description="the W&B project of the wandb sink")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline writes the W&B run to disk only (`wandb sync` uploads it later)")


class JobConfig(Strict):
    """A whole RL job. Every service reads the same validated config."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)

    job_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:8], description="namespaces streams")
    seed: int = Field(0, description="the job's seed: the controller's problem draws (one per admission index), "
                      "rollout's sampling (one stream per traj_id) and the trainer's torch RNG all derive from it; "
                      "the base model has its own, model.warm_start.seed")
    model: ModelConfig = Field(default_factory=ModelConfig)
    tasks: list[TaskEntry] = Field(default_factory=lambda: [RegisteredTaskConfig(name="arithmetic")], min_length=1,
                                   description="the task mix: registered tasks by name, `kind: dataset` "
                                   "entries read from files, `kind: gymnasium` environments, `kind: reasoning_gym` "
                                   "datasets and `kind: agent` programs")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    def task_eta(self, task: str) -> int:
        """`task`'s staleness bound eta: its own `max_staleness` (async jobs only), else the job's."""
        own = next(entry.max_staleness for entry in self.tasks if entry.name == task)
        return self.staleness.eta if own is None else own

    def task_eta_hard(self, task: str) -> int:
        """The largest lag a trained token of `task` may have."""
        return eta_hard_of(self.task_eta(task))

    @property
    def has_agents(self) -> bool:
        """Whether a task is an agent's: then every pool runs environment workers (`rollout.pools[].env_workers`)."""
        return any(isinstance(task, AgentTaskConfig) for task in self.tasks)

    def env_faults(self, task: str) -> EnvFaults | None:
        """The faults injected into `task`'s environments (`tasks[].env_faults`), if any."""
        for entry in self.tasks:
            if entry.name == task and isinstance(entry, RegisteredTaskConfig | GymTaskConfig):
                return entry.env_faults
        return None

    def build_tasks(self, rewards: Rewards | None = None) -> TaskSet:
        """The job's tasks, each built from its entry in order (an agent's environment is one listed before it);
        with `rewards`, the reward functions that score them. Each service builds them once, at its entry."""
        configured: dict[str, Task] = {}
        for entry in self.tasks:
            if not isinstance(entry, RegisteredTaskConfig):
                configured[entry.name] = entry.build(self.seed, TaskSet(configured))
        return TaskSet(configured, rewards)

    @model_validator(mode="after")
    def _known_tasks(self) -> JobConfig:
        names = [task.name for task in self.tasks]
        if len(set(names)) < len(names):
            raise ValueError(f"tasks: a task appears twice ({names})")
        valid = sorted({*TASKS, *names})
        environments = {name for name, task in TASKS.items() if is_multi_turn(task)}
        for i, task in enumerate(self.tasks):
            if isinstance(task, RegisteredTaskConfig):
                if task.name not in TASKS:
                    raise ValueError(f"tasks.{i}.name: unknown task {task.name!r}; valid: {valid}")
            elif task.name in TASKS:
                raise ValueError(f"task {task.name!r}: a built-in task has that name")
            self._check_entry(task)
            if isinstance(task, GymTaskConfig):
                environments.add(task.name)
            faulty = isinstance(task, RegisteredTaskConfig | GymTaskConfig) and task.env_faults is not None
            if faulty and task.name not in environments:
                raise ValueError(f"tasks.{i}.env_faults: task {task.name!r} has no environment to make flaky")
            if isinstance(task, AgentTaskConfig) and task.environment is not None:
                if task.environment not in {*TASKS, *names[:i]}:
                    raise ValueError(f"tasks.{i}.environment: unknown task {task.environment!r}; valid: a registered "
                                     f"task or one listed before it ({sorted({*TASKS, *names[:i]})})")
                if task.environment not in environments:
                    raise ValueError(f"agent task {task.name}: environment {task.environment!r} is not a multi-turn "
                                     "task")
            if task.max_staleness is not None and self.staleness.mode == "sync":
                raise ValueError(f"tasks.{i}.max_staleness: a task's own staleness bound needs staleness.mode "
                                 "async (a sync job trains every token at the version that sampled it)")
        for pool in self.rollout.pools:
            if (pool.max_batch or self.rollout.max_batch) < self.trainer.group_size:
                raise ValueError(f"rollout.max_batch (or pool {pool.name}'s max_batch) must be >= "
                                 "trainer.group_size (a group decodes together)")
            for task in pool.tasks:
                if task not in valid:
                    raise ValueError(f"rollout pool {pool.name}: unknown task {task!r}; valid: {valid}")
        for task in self.reward.task_backends:
            if task not in valid:
                raise ValueError(f"reward.task_backends: unknown task {task!r}; valid: {valid}")
        return self

    def _check_entry(self, task: TaskEntry) -> None:
        """What a kind of entry needs of the rest of the job (the model's tokenizer and chat template)."""
        if isinstance(task, DatasetTaskConfig) and task.messages_field is not None and not self.model.chat_template:
            raise ValueError(f"dataset task {task.name}: messages_field needs model.chat_template: true")
        if isinstance(task, ReasoningGymTaskConfig) and self.model.path is None and self.model.tokenizer is None:
            raise ValueError(f"reasoning_gym task {task.name}: its prompts are English with capitals, which "
                             "the tiny model's char vocabulary cannot spell; set model.tokenizer (a byte-level "
                             "BPE such as configs/models/bpe-math) or model.path")
        if isinstance(task, AgentTaskConfig) and ((self.model.path is None and self.model.tokenizer is None)
                                                  or not self.model.chat_template):
            raise ValueError(f"agent task {task.name}: its gateway renders chat messages with the model's "
                             "chat template: set model.chat_template: true and a model that ships one "
                             "(model.tokenizer such as configs/models/bpe-agent, or model.path)")


def _set_dotted(tree: dict[str, Any], dotted: str, raw: str) -> None:
    """`a.b=c`; a number after a list names its element (`tasks.1.weight=2`)."""
    keys = dotted.split(".")
    node: Any = tree
    for depth, key in enumerate(keys):
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"--set {dotted}: {'.'.join(keys[:depth])} is a list of {len(node)}; "
                                  f"{key!r} is not an index in it")
            index: int | str = int(key)
        elif isinstance(node, dict):
            index = key
        else:
            raise ConfigError(f"--set {dotted}: {'.'.join(keys[:depth])!r} is not a section")
        if depth == len(keys) - 1:
            node[index] = yaml.safe_load(raw)
        elif isinstance(node, dict):
            node = node.setdefault(key, {})
        else:
            node = node[index]


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


def config_tree(config: JobConfig) -> dict[str, Any]:
    """The config as plain JSON values: what events, files and trackers hold of it (`validate_config` reads it)."""
    return config.model_dump(mode="json")


def config_to_json(config: JobConfig) -> str:
    """The config as a file holds it."""
    return json.dumps(config_tree(config), indent=2)
