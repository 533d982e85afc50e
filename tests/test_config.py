import pytest
from helpers import load_benchmark

from agentree.algorithms.advantages import ESTIMATORS_BY_NAME
from agentree.config import available_configs, load_config


def test_shipped_configs_validate():
    names = available_configs()
    assert {"frozenlake_patr", "frozenlake_grpo", "frozenlake_tree_random"} <= set(names)
    for name in names:
        cfg = load_config(name)
        assert cfg.env["name"] and cfg.rollout["name"]


def test_defaults_are_the_paper_values():
    """Every PATR value the paper states (§4, §5.1, App. A), in the code defaults and the config."""
    from agentree.config import EngineConfig, TrainConfig
    from agentree.envs.frozenlake import FrozenLakeConfig
    from agentree.rollout.turn.patr import PATRConfig

    paper = {"B0": 4, "K": 5, "M": 2, "top_k": 2, "alpha": 0.5, "theta": 6}
    code = PATRConfig()
    assert {k: getattr(code, k) for k in paper} == paper
    assert code.theta_at == "checkpoint"  # Algorithm 1, line 8
    assert code.group == "keep-all"  # Eq. 6: G(x) = C, pruned branches included
    fl = FrozenLakeConfig()
    assert fl.max_turns == 10 and fl.is_slippery is False and fl.invalid_penalty == 0.0
    assert EngineConfig().temperature == 1.0
    tc = TrainConfig()  # App. A: lr 1e-6, clipping ratio 0.28, KL 0.001
    assert (tc.lr, tc.eps_high, tc.kl_coef) == (1e-6, 0.28, 0.001)
    assert tc.advantage == "grpo" and tc.adv_scale == "std"  # Eq. 9
    assert tc.epochs == 1 and tc.minibatches == 1  # on-policy: rho = 1 at the first step
    for name in ("frozenlake_patr", "frozenlake_patr_eq2"):
        cfg = load_config(name)
        assert {k: cfg.rollout[k] for k in paper} == paper, name
        assert cfg.rollout["theta_at"] == "checkpoint" and cfg.rollout["group"] == "keep-all"
        assert cfg.env["max_turns"] == 10 and cfg.env["is_slippery"] is False
        assert cfg.engine.temperature == 1.0 and cfg.scorer["name"] == "bfs"
        assert cfg.train.eps_high == 0.28
    # SWE: the same values except K (13 in the paper; CPU-sized to 3 in the shipped config)
    swe = load_config("swebench_patr")
    assert {k: swe.rollout[k] for k in paper if k != "K"} == {
        k: paper[k] for k in paper if k != "K"
    }
    assert swe.train.kl_coef == 0.001 and swe.train.eps_low == swe.train.eps_high == 0.28


def test_eq2_config_is_patr_eq2_as_printed():
    t = load_config("frozenlake_patr_eq2").train
    assert t.loss_agg == "seq-mean"  # 1/G sum_i 1/|tau_i| sum_t
    assert t.eps_low == t.eps_high == 0.28  # clip(rho, 1 - eps, 1 + eps), eps = 0.28
    assert t.kl_coef == 0.001
    assert t.clip_ratio_c is None and t.log_ratio_clamp is None
    assert t.advantage == "grpo" and t.adv_scale == "std" and t.advantage_options == {}


# What each objective named in a config's "# Objective:" header means, as train settings.
OBJECTIVES = {
    "PATR Eq. 2": {"loss_agg": "seq-mean", "eps_low": 0.28, "eps_high": 0.28, "kl_coef": 0.001},
    "DAPO with TreeRL's KL": {"loss_agg": "token-mean", "eps_low": 0.2, "eps_high": 0.28},
    "DAPO": {"loss_agg": "token-mean", "eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.0},
    "GRPO": {"loss_agg": "seq-mean", "eps_low": 0.2, "eps_high": 0.2, "kl_coef": 0.0},
}


def test_every_shipped_config_says_which_objective_it_optimises():
    from importlib import resources

    for name in available_configs():
        text = resources.files("agentree.configs").joinpath(f"{name}.yaml").read_text()
        assert text.startswith("# Objective: "), f"{name}.yaml must open with '# Objective:'"
        head = text.splitlines()[0].removeprefix("# Objective: ")
        label = next((k for k in OBJECTIVES if head.startswith(k)), None)
        assert label is not None, f"{name}.yaml names an unknown objective: {head}"
        train = load_config(name).train
        for key, value in OBJECTIVES[label].items():
            assert getattr(train, key) == value, (name, label, key)


def test_typos_are_errors_naming_the_key():
    with pytest.raises(ValueError, match=r"unknown config key 'train.lrr'"):
        load_config(overrides=["train.lrr=0.1"])
    with pytest.raises(ValueError, match=r"unknown config key 'rollout.B00'"):
        load_config(overrides=["rollout.B00=3"])
    with pytest.raises(ValueError, match=r"unknown config key 'env.sizee'"):
        load_config(overrides=["env.sizee=3"])
    with pytest.raises(ValueError, match=r"bad value for 'train.steps'"):
        load_config(overrides=["train.steps=many"])
    with pytest.raises(ValueError, match=r"unknown rollout 'patrr'"):
        load_config(select={"rollout": "patrr"})


def test_overrides_and_component_switches():
    cfg = load_config(overrides=["train.lr=0.5", "rollout.K=3", "engine.stop=[]"])
    assert cfg.train.lr == 0.5 and cfg.rollout["K"] == 3 and cfg.engine.stop == []
    cfg = load_config(select={"rollout": "grpo", "steps": "7"})
    grpo = {"name": "grpo", "env_step_budget": None, "budget_reserve": False, "G": 8}
    assert cfg.rollout == grpo  # grpo defaults
    assert cfg.train.steps == 7
    cfg = load_config(select={"env": "custom_env.mygame:GuessEnv"}, overrides=["env.high=4"])
    assert cfg.env == {"name": "custom_env.mygame:GuessEnv", "high": 4, "max_turns": 6}


def test_config_files(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("env: {name: frozenlake, size: 3}\ntrain: {steps: 2}\n")
    cfg = load_config(str(path))
    assert cfg.env["size"] == 3 and cfg.train.steps == 2
    with pytest.raises(ValueError, match="no config named"):
        load_config("nope")


def test_runtime_sampling_carries_the_env_stop_sequences(tiny_frozenlake):
    from agentree.run.runtime import Runtime

    rt = Runtime(load_config(), log=lambda s: None)
    assert "```Up```" in rt.rollouts.sampling().stop
    rt.close()
    rt = Runtime(load_config(overrides=["env.stop_after_move=false"]), log=lambda s: None)
    assert rt.rollouts.sampling().stop == ()
    rt.close()


def test_env_selects_its_own_default_config():
    assert load_config(select={"env": "swebench"}).rollout["K"] == 3
    assert load_config(select={"env": "countdown"}).rollout["name"] == "latr"
    assert load_config(select={"env": "math"}).rollout["name"] == "treepo"
    user = load_config(select={"env": "custom_env.mygame:GuessEnv"})
    assert user.rollout["name"] == "patr" and user.env["name"].endswith("GuessEnv")


def test_train_advantage_takes_a_users_estimator_as_the_seam_does():
    # `train.advantage` accepts what the estimator registry resolves: a shipped name or a
    # user's `package.module:function`, imported when the config is validated (as a
    # `module:Class` env, controller or scorer is), so a typo fails before any run starts.
    credit = load_benchmark("tree_credit")
    cfg = load_config(overrides=["train.advantage=tree_credit:shared"])
    assert cfg.train.advantage == "tree_credit:shared"
    assert ESTIMATORS_BY_NAME.get(cfg.train.advantage) is credit.shared
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        load_config(overrides=["train.advantage=no_such_module:estimate"])
    with pytest.raises(ValueError, match=r"unknown advantage estimator .ppo.*module:function"):
        load_config(overrides=["train.advantage=ppo"])
