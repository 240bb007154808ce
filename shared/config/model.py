"""model: the base model's shape, and the warm start that builds it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from jetroll.shared.schema import Strict


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
    task_weights: dict[str, float] = Field(default_factory=dict, description="a task's share of the SFT examples "
                                           "against the others' (default 1 each): a task that learns fast gets "
                                           "less, so every task's base leaves RL room")
    init_from: WarmStartConfig | None = Field(
        None, description="start from the base model this earlier warm start builds (cached on its own, e.g. the "
        "default job's) instead of a random init; None: random init")

    @model_validator(mode="after")
    def _band(self) -> WarmStartConfig:
        unknown = sorted(set(self.task_weights) - set(self.tasks))
        if unknown or any(weight <= 0 for weight in self.task_weights.values()):
            raise ValueError(f"model.warm_start.task_weights: each must be > 0 and name one of tasks {self.tasks}; "
                             f"got {self.task_weights}")
        if self.target_band is not None:
            low, high = self.target_band
            if not 0 <= low < high <= 1:
                raise ValueError(f"model.warm_start.target_band must be (low, high) with 0 <= low < high <= 1, "
                                 f"got {self.target_band}")
        return self


class ModelConfig(Strict):
    """The policy: an HF-format directory, or the tiny built-in model that `jetroll init-model` builds."""

    init: Literal["tiny", "pretrained", "random"] | None = Field(
        None, description="where the policy's weights come from. tiny: the built-in model, warm-started and cached "
        "(model.path unset); pretrained: the HF-format checkpoint at model.path; random: the architecture of "
        "model.path's config.json with random N(0, 0.02) weights (built once, cached, seeded by init_seed) and its "
        "tokenizer files. None: pretrained when model.path is set, else tiny")
    path: str | None = Field(None, description="HF-format model dir (config.json, tokenizer files and, for "
                             "init: pretrained, the weights); None builds/uses the cached tiny model")
    init_seed: int = Field(0, description="seed of the random weights of init: random")
    tokenizer: str | None = Field(None, description="init: tiny only: a dir with tokenizer.json and "
                                  "tokenizer_config.json (e.g. a BPE tokenizer with a chat template) that the tiny "
                                  "model is built on; None: the built-in char-level vocabulary")
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
    chat_template: bool = Field(False, description="render each task prompt as a user message through the model's "
                                "chat template (with the generation prompt); false feeds the prompt as it is")
    system_prompt: str | None = Field(None, min_length=1, description="a system message before each prompt "
                                      "(needs chat_template: true)")

    @model_validator(mode="after")
    def _init_needs_its_path(self) -> ModelConfig:
        if self.init == "tiny" and self.path is not None:
            raise ValueError("model.init: tiny builds its own model; drop model.path, or set model.init: pretrained "
                             "(a checkpoint) or random (its config.json with random weights)")
        if self.init in ("pretrained", "random") and self.path is None:
            raise ValueError(f"model.init: {self.init} needs model.path, an HF-format model dir")
        if self.tokenizer is not None and self.path is not None:
            raise ValueError("model.tokenizer is for the tiny model; a model at model.path brings its own tokenizer")
        return self

    @model_validator(mode="after")
    def _system_prompt_needs_a_template(self) -> ModelConfig:
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("model.system_prompt needs model.chat_template: true (a system message needs a template)")
        return self

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("model.hidden_size must be divisible by model.num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.num_heads must be divisible by model.num_kv_heads")
        return self
