"""Experiment configuration: YAML in `configs/`, validated by pydantic, overridable from the CLI.

The top level composes one section per component. `env`, `rollout` and `scorer` name a
component (`name:`) and carry that component's own settings, validated by the component's
`Config` class, so a typo anywhere is an error that names the key. Selecting a different
component on the command line (`--rollout grpo`) starts that section from the component's
defaults; `--set a.b=c` then overrides single keys (values parsed as YAML).
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentree.algorithms.advantages import advantage_estimator
from agentree.envs.base import env_class, format_validation_error
from agentree.hub.store import policy_record
from agentree.hub.tiny import TinyModelConfig
from agentree.models.warm import WarmConfig
from agentree.rollout.base import controller_class
from agentree.scorers.base import scorer_class

DEFAULT_CONFIG = "frozenlake_patr"
ENV_CONFIGS = {
    "frozenlake": "frozenlake_patr",
    "swebench": "swebench_patr",
    "countdown": "countdown_latr",
    "math": "math_treepo",
    "sokoban": "sokoban_patr",
}
"""The config `--env NAME` starts from when no `--config` is given."""


BUILT_POLICIES = {
    "tiny": "a 2-layer Qwen2-architecture model with random weights and a tokenizer trained on "
    "the env's text; built per env in seconds",
    "tiny-warm": "tiny fine-tuned on a noisy scripted expert of the env; built per env in about "
    "3-4 min (one thread)",
    "warm": "policy.warm.base (a pretrained model) fine-tuned on that expert; built per env and "
    "base",
}
"""`policy.path` names agentree builds itself (cached), with what each is; any other value is
a checkpoint."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PolicyConfig(_Section):
    path: str = "tiny"
    """`tiny` (built locally for the env), `tiny-warm` (tiny fine-tuned on a noisy scripted
    expert, FrozenLake and Countdown), `warm` (`warm.base` fine-tuned on that expert), a named
    pretrained checkpoint (`smollm2-135m`, see `agentree models list`), a checkpoint directory,
    a .gguf file, or a hub id."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Shape of the locally built tiny policy."""
    warm: WarmConfig = Field(default_factory=WarmConfig)
    """How `warm`/`tiny-warm` is built: base policy, expert probability, demonstrations, SFT."""
    dtype: str = "auto"
    """Model dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16."""
    device: str = "auto"
    """auto, cpu, cuda, cuda:1, ..."""
    tool_format: str = "text"
    """How the policy writes tool calls for envs with tools (`agentree.tools`): hermes (Qwen,
    Hermes), llama3_json, pythonic, qwen3_coder (Qwen3-Coder's XML), mistral, mistral_json, or
    text (free-text actions; a tool env reads the generic rendering's hermes calls). Warm
    builds write their demonstrations' calls in it. Unset, a policy directory agentree wrote (a
    checkpoint, `agentree sft`/`export` output) gives the format it was trained in, and sets
    the env's `action_format` it acted in where the config leaves that unset
    (`POLICY_RECORD`)."""


class EngineConfig(_Section):
    backend: Literal["auto", "transformers", "vllm"] = "transformers"
    """Rollout engine; auto: vLLM where it is installed, else transformers."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (the paper uses 1.0); 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling; 0 disables."""
    max_tokens: int = Field(256, ge=1)
    """Tokens per response (per turn)."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a response as soon as it contains one, besides the env's own."""
    max_context: int = Field(8192, ge=16)
    """Token budget for a whole branch; a branch that would exceed it ends as max_tokens."""
    history: str = Field("all", pattern=r"^(all|last:[1-9][0-9]*)$")
    """What each turn's prompt holds: `all` (append-only: the whole episode so far, trained as
    one sequence), or `last:k`, the task (system prompt and first observation) and the last k
    turns (each the sampled action and the observation after it), as verl-agent's memory
    shows a bounded history; every turn is then trained as its own sequence, on exactly the
    prompt it was sampled against, with the advantage the estimator gives that turn's tokens.
    For episodes longer than the model's context; `max_context` then bounds each turn's
    prompt. Held-out evaluation uses the same window."""
    prefix_cache_mb: int = Field(1024, ge=0)
    """Memory for cached prefix KV (transformers engine); 0 turns the cache off. It should hold
    the histories a rollout keeps live (every branch of the step's trees, at 2 x layers x KV
    heads x head dim x dtype bytes a token: `--dry-run` prints how many tokens fit); what it
    drops for room, the next turn computes again (`rollout/policy_tokens_evicted`), and the
    trainer says so once."""
    max_batch_size: int = Field(256, ge=1)
    """Most sequences decoded together (transformers engine)."""
    env_workers: int = Field(8, ge=1)
    """Threads stepping environments concurrently."""
    vllm: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for vllm.LLM (e.g. gpu_memory_utilization)."""

    @property
    def history_window(self) -> int | None:
        """k of `history: last:k`; None for `all`."""
        return None if self.history == "all" else int(self.history.split(":")[1])


class LoraSettings(_Section):
    r: int = Field(0, ge=0)
    """LoRA rank; 0 trains all weights."""
    alpha: float = Field(32.0, gt=0.0)
    """LoRA scale numerator: the update is (alpha / r) * B A."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """Linear layers that get adapters (names inside each transformer block)."""


class TrainConfig(_Section):
    steps: int = Field(100, ge=0)
    """Optimiser steps (one rollout batch each)."""
    tasks_per_step: int = Field(8, ge=1)
    """Tasks (trees) per rollout batch."""
    lr: float = Field(1e-6, gt=0.0)
    """Learning rate (paper: 1e-6 for real models)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up: optimiser step s (0-based) runs at lr * (s + 1) /
    warmup_steps until the schedule takes over (0: none). Against a dip of held-out success in
    the first updates from a warm start, when the first groups' advantages are noisiest."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine decay to `lr_min_ratio * lr` at the last step."""
    lr_min_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Final learning rate of the cosine schedule, relative to `lr`."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Max global gradient norm."""
    eps_low: float = Field(0.2, ge=0.0)
    """Lower clip of the importance ratio (1 - eps_low)."""
    eps_high: float = Field(0.28, ge=0.0)
    """Upper clip (1 + eps_high); 0.28 is DAPO's clip-higher and the PATR paper's value."""
    kl_coef: float = Field(0.001, ge=0.0)
    """Weight of the k3 KL penalty to the initial policy (paper: 0.001); 0 disables it."""
    clip_ratio_c: float | None = Field(3.0, gt=1.0)
    """Dual-clip: a negative-advantage token's loss is capped at c|A| (verl: 3); null disables."""
    log_ratio_clamp: float | None = Field(20.0, gt=0.0)
    """Clamp log(pi/pi_old) to +-this before exp (verl: 20), for stale data; null disables."""
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    """token-mean (DAPO: every policy token of the batch alike) or seq-mean (GRPO/PATR Eq. 2:
    the mean over each trajectory's tokens, then over trajectories). Under a history window
    (`engine.history: last:k`) each turn is trained as its own row, and seq-mean still weighs
    every trajectory alike: a turn's tokens are divided by its whole trajectory's."""
    advantage: str = "grpo"
    """grpo: outcome reward normalised over the tree's group (PATR Eq. 9); gigpo: episode plus
    anchor-state step advantages; rtmc: Q(s, a) - V(s) from returns pooled over shared states;
    treegrpo: intra- plus inter-tree GRPO; treepo, treerl (see `agentree.algorithms.advantages`);
    or a user's estimator as `package.module:function`."""
    advantage_options: dict[str, Any] = Field(default_factory=dict)
    """Options of the estimator, e.g. treepo {norm: batch|batch-std|tree-std|none,
    distinct_subgroups: bool, eps}; grpo {eps} (its std scaling is `adv_scale`); gigpo
    {step_gamma: 0.95, episode_weight: 1, step_weight: 1, norm: mean|std, episode_stats:
    steps|trajectories, state_key: env|observation, eps}; rtmc {gamma: 1, signature:
    state|history, prior: 0, state_key}; treegrpo {eps}."""
    adv_scale: Literal["std", "none"] = "std"
    """Divide group advantages by the group std (GRPO) or not (Dr. GRPO)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill the batch with new tasks."""
    max_refill_rounds: int = Field(3, ge=0)
    """Extra rollout rounds dynamic sampling may spend to refill one batch."""
    micro_batch_size: int = Field(32, ge=1)
    """Sequences per forward/backward (gradient accumulation over the batch)."""
    epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""
    minibatches: int = Field(1, ge=1)
    """Optimiser steps per pass (>1 makes later updates off-policy, where clipping acts)."""
    packing: Literal["auto", "tree", "padded"] = "auto"
    """Update layout: tree-packed rows (shared prefixes forwarded once), one padded row per
    trajectory, or auto: whichever `agentree.algorithms.packing.layout_cost` estimates cheaper per
    batch."""
    save_every: int = Field(50, ge=0)
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Most recent checkpoints kept on disk."""
    trees_every: int = Field(10, ge=0)
    """Write the step's trees to trees/ every N steps (0: never)."""
    eval_every: int = Field(0, ge=0)
    """Held-out evaluation every N steps (0: only before and after training). An evaluation
    seeds the rollout engine with its own seed, and the steps after it draw on from there: two
    runs that evaluate at different steps train on different draws (equal in distribution)."""
    max_minutes: float = Field(0.0, ge=0)
    """Stop after the first step that ends past this many minutes of training (0: no limit),
    then evaluate and save as at the last step. The clock counts rollouts, updates and
    checkpoints but not held-out evaluations, and a resumed run continues it."""
    world_size: int = Field(1, ge=1)
    """Training ranks (processes); >1 needs `fsdp: true`."""
    fsdp: bool = False
    """Shard parameters, gradients and optimiser state over the ranks with FSDP2."""
    lora: LoraSettings = Field(default_factory=LoraSettings)
    """LoRA adapters (peft); `r: 0` trains all weights."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Training compute dtype; bf16 keeps fp32 master weights and fp32 gradient reduction."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them."""
    logits_chunk: int = Field(0, ge=0)
    """Tokens per slice of the output layer in the loss (0: all at once); the fp32 logits
    then exist for one slice at a time, recomputed in the backward pass."""

    rollout_is: Literal["none", "token", "sequence"] = "none"
    """Rollout importance sampling (verl's rollout IS, truncated IS): weight each token's
    policy-gradient term by min(pi_old / mu, rollout_is_cap), the ratio between the trainer's
    old-policy log-probs and the sampling engine's (mu), per token or per sequence; none: off."""
    rollout_is_cap: float = Field(2.0, gt=0.0)
    """Truncation of the rollout IS weights (verl: 2; token level 1.5-5, sequence level 2-10)."""

    async_steps: int = Field(0, ge=0, le=1)
    """1: roll out step t+1 while step t trains (staleness 1, pi_old = sampling log-probs, or
    the trainer's with `rollout_is`)."""

    def advantage_kwargs(self) -> dict[str, Any]:
        """The options `compute_advantages` takes for `advantage`: `advantage_options`, plus
        GRPO's std scaling (`adv_scale`). The update and the viewer both read them here."""
        scale = {"scale": self.adv_scale} if self.advantage == "grpo" else {}
        return {**scale, **self.advantage_options}

    @model_validator(mode="after")
    def _advantage_options(self) -> TrainConfig:
        if "scale" in self.advantage_options:
            raise ValueError("set the grpo std scaling with train.adv_scale, not advantage_options")
        advantage_estimator(self.advantage, self.advantage_options)  # a bad name fails here
        return self

    @model_validator(mode="after")
    def _check_learner(self) -> TrainConfig:
        """Combinations no learner can run, rejected with the fix."""
        if self.world_size > 1 and not self.fsdp:
            raise ValueError("train.world_size > 1 needs train.fsdp=true (ranks shard the model)")
        if self.dtype == "bf16" and not self.fsdp and not self.lora.r:
            raise ValueError(
                "train.dtype=bf16 needs train.fsdp=true (FSDP2's mixed precision keeps the fp32 "
                "master weights; world_size 1 is fine) or LoRA (train.lora.r > 0: a bf16 frozen "
                "base)"
            )
        return self


class EvalConfig(_Section):
    tasks: int | str = 64
    """Held-out tasks: a count (seeds disjoint from training), a JSON/JSONL file, or a named
    source such as `local`."""
    samples: int = Field(4, ge=1)
    """Samples per task (the paper samples each test prompt 4 times)."""
    temperature: float | None = None
    """Sampling temperature for evaluation; null uses engine.temperature."""
    save_every: int = Field(64, ge=1)
    """`agentree eval` samples this many tasks as one block with its own seed and saves each
    block as it finishes, so a stopped evaluation resumes (`--resume`) from its last block;
    an evaluation of up to this many tasks is one block. Training's evaluation is one block."""


class WandbConfig(_Section):
    project: str | None = None
    """W&B project; setting it turns W&B logging on (WANDB_MODE=offline is respected)."""
    entity: str | None = None
    """W&B entity (team or user); default: the logged-in user's."""
    name: str | None = None
    """Run name; default: the run directory's name."""
    trees: bool = True
    """Log the tree viewer's HTML as an artifact whenever the step's trees are saved."""


class LogConfig(_Section):
    tensorboard: bool = False
    """Write TensorBoard event files to RUN_DIR/tensorboard."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases logging (off unless `project` is set)."""


class DistributedConfig(_Section):
    backend: Literal["local", "ray"] = "local"
    """local: everything in this process; ray: rollout workers and engines as Ray actors."""
    address: str = "local"
    """local (a private Ray instance here), auto (the running cluster) or ray://host:port."""
    rollout_workers: int = Field(2, ge=1)
    """Rollout worker actors; each owns the envs and sandboxes of the trees it runs."""
    engine_replicas: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    """Policy engine actors shared by the workers; 0 gives every worker its own engine. `auto`:
    0 when the engines run on CPU (engine_gpus 0, or no GPU in the cluster), where a shared
    replica measured slower than an engine per worker, else 1."""
    max_sandboxes_per_worker: int = Field(32, ge=1)
    """Most envs (Docker sandboxes) one worker holds at a time; bounds trees per call."""
    worker_cpus: float = Field(1.0, ge=0.0)
    """Ray CPUs reserved by each rollout worker."""
    engine_cpus: float = Field(1.0, ge=0.0)
    """Ray CPUs reserved by each engine replica."""
    engine_gpus: float = Field(0.0, ge=0.0)
    """Ray GPUs reserved by each engine replica."""
    scorer_cpus: float = Field(1.0, ge=0.0)
    """Ray CPUs reserved by the scorer actor (started for scorers that hold a model: prm)."""
    scorer_gpus: float = Field(0.0, ge=0.0)
    """Ray GPUs reserved by the scorer actor."""
    max_restarts: int = Field(3, ge=-1)
    """Times Ray restarts a dead worker or engine actor (-1: forever)."""
    tree_timeout_s: float = Field(1800.0, gt=0.0)
    """A worker call running longer than this per tree is killed; its trees end as env_error."""
    start_timeout_s: float = Field(300.0, gt=0.0)
    """Time allowed for actors to start (model load included)."""
    py_modules: list[str] = Field(default_factory=list)
    """Local packages shipped to every worker (Ray runtime_env), e.g. the package of a
    `module:Class` env that the other nodes do not have installed."""


class ExperimentConfig(_Section):
    seed: int = 0
    """Seeds weights of tiny policies, task order and sampling."""
    tasks: int | str = 10000
    """Training tasks: a count (generated, seeded), a JSON/JSONL file, or a named source."""
    output: str | None = None
    """Run directory; default runs/<time>-<env>-<rollout>."""
    env: dict[str, Any] = Field(default_factory=lambda: {"name": "frozenlake"})
    """Environment: `name` plus that env's settings."""
    rollout: dict[str, Any] = Field(default_factory=lambda: {"name": "patr"})
    """Rollout controller: `name` plus its settings."""
    scorer: dict[str, Any] = Field(default_factory=lambda: {"name": "bfs"})
    """Process scorer: `name` plus its settings."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    """Experiment trackers (TensorBoard, Weights & Biases) besides metrics.jsonl."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    def component(self, section: str) -> tuple[str, dict[str, Any]]:
        """(name, settings) of the env/rollout/scorer section."""
        d = dict(getattr(self, section))
        return d.pop("name"), d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


def available_configs() -> list[str]:
    files = resources.files("agentree.configs").iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".yaml"))


def read_config_file(name_or_path: str) -> dict[str, Any]:
    """A config by file path or by name from the shipped `configs/`."""
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.exists():
            raise ValueError(f"config file {path} does not exist")
        text = path.read_text()
    else:
        res = resources.files("agentree.configs").joinpath(f"{name_or_path}.yaml")
        if not res.is_file():
            raise ValueError(
                f"no config named {name_or_path!r}; shipped configs: "
                f"{', '.join(available_configs())} (or pass a YAML file)"
            )
        text = res.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"config {name_or_path} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {name_or_path} must be a YAML mapping")
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ValueError(f"--set expects key=value, got {item!r}")
    key, _, raw = item.partition("=")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def load_config(
    config: str | None = None,
    *,
    select: dict[str, str | None] | None = None,
    overrides: list[str] | None = None,
) -> ExperimentConfig:
    """Read a config, switch components, apply `--set` overrides, validate everything."""
    env = (select or {}).get("env")
    default = ENV_CONFIGS.get(env, DEFAULT_CONFIG) if env else DEFAULT_CONFIG
    data = copy.deepcopy(read_config_file(config or default))
    for section, name in (select or {}).items():
        if name is None:
            continue
        current = data.get(section) or {}
        if section in ("env", "rollout", "scorer"):
            if current.get("name") != name:
                data[section] = {"name": name}
        elif section == "policy":
            data.setdefault("policy", {})["path"] = name
        elif section == "steps":
            data.setdefault("train", {})["steps"] = int(name)
        else:
            data[section] = name
    for item in overrides or []:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"--set {item}: '{k}' is not a section")
            node = nxt
        node[keys[-1]] = value
    # a policy directory agentree wrote says how the policy learned to act: what the config
    # leaves unset follows it
    policy = data.get("policy") or {}
    path = policy.get("path")
    record = policy_record(path) if isinstance(path, str) and path not in BUILT_POLICIES else {}
    if "tool_format" in record and "tool_format" not in policy:
        policy["tool_format"] = record["tool_format"]
    cfg = validate_config(data)
    env = data.get("env")
    if (
        "action_format" in record
        and "action_format" in cfg.env  # the env has the setting
        and not (isinstance(env, dict) and "action_format" in env)
    ):
        data["env"] = {**cfg.env, "action_format": record["action_format"]}
        cfg = validate_config(data)
    return cfg


def validate_config(data: dict[str, Any]) -> ExperimentConfig:
    try:
        cfg = ExperimentConfig(**data)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, "config").replace("'config.", "'")) from None
    resolvers = {"env": env_class, "rollout": controller_class, "scorer": scorer_class}
    for section, resolve in resolvers.items():
        sec = getattr(cfg, section)
        if "name" not in sec:
            raise ValueError(f"config section '{section}' needs a 'name'")
        name, settings = cfg.component(section)
        cls = resolve(name)
        try:
            validated = cls.Config(**settings).model_dump()
        except ValidationError as e:
            raise ValueError(format_validation_error(e, section)) from None
        setattr(cfg, section, {"name": name, **validated})
    return cfg
