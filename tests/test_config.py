"""Config parsing: presets, overrides, and clear errors for unknown keys and bad values."""

import pytest
from conftest import ROOT

from jaxllm.config import Config, ConfigError, load_config, parse_overrides, save_config

CONFIGS = ROOT / "configs"


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_preset_loads(preset):
    assert isinstance(load_config(CONFIGS / preset), Config)


def test_overrides_apply_with_types():
    cfg = load_config(
        CONFIGS / "ar.yaml",
        [
            "--model.n_layers=1",
            "--optim.lr",
            "3e-3",
            "--execution.compute_dtype=bfloat16",
            "--train.progress=false",
            "--model.d_ff=null",
        ],
    )
    assert cfg.model.n_layers == 1 and cfg.optim.lr == 3e-3
    assert cfg.execution.compute_dtype == "bfloat16" and cfg.train.progress is False
    assert cfg.model.d_ff is None and isinstance(cfg.optim.lr, float)


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"'n_layer' is not in model; valid: \[.*'n_layers'"):
        load_config(None, ["--model.n_layer=2"])
    with pytest.raises(ConfigError, match="not in top level"):
        load_config(None, ["--modle.n_layers=2"])


def test_label_smoothing_refused_on_the_fused_loss():
    with pytest.raises(ConfigError, match="label_smoothing needs execution.loss_impl=xla"):
        load_config(None, ["--execution.label_smoothing=0.1", "--execution.loss_impl=pallas"])


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"])
def test_an_empty_preset_is_an_error_not_the_defaults(tmp_path, text):
    p = tmp_path / "empty.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="empty.yaml is empty: a preset sets at least model"):
        load_config(p)


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  d_modle: 64\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['d_modle'\] at model"):
        load_config(p)


@pytest.mark.parametrize(
    "override, message",
    [
        ("--model.n_layers=two", "model.n_layers must be an integer"),
        ("--model.n_layers=2.5", "model.n_layers must be an integer"),
        ("--execution.compute_dtype=float16", r"must be one of \['float32', 'bfloat16'\]"),
        ("--model.d_model=30", "divisible by model.n_heads"),
        ("--execution.dropout=1.0", r"dropout must be in \[0, 1\)"),
        ("--execution.label_smoothing=1.0", r"label_smoothing must be in \[0, 1\)"),
        ("--optim.lr=-1", "optim.lr must be > 0"),
        ("--train.steps=0", "train.steps must be > 0"),
        ("--optim.warmup_steps=5000", "warmup_steps"),
        ("--train.progress=maybe", "true or false"),
        (
            "--data.associative_recall.num_pairs=17",
            r"num_pairs must be in \[1, vocab_size/2 = 16\]",
        ),
        ("--model.context_length=9", "2 \\* num_pairs \\+ 1 = 17"),
        ("--execution.residual_dtype=bfloat16", "bfloat16 needs execution.compute_dtype"),
        ("--execution.residual_dtype=float16", r"must be one of \['float32', 'bfloat16'\]"),
    ],
)
def test_bad_values_name_the_key_and_range(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / "ar.yaml", [override])


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected an override"):
        parse_overrides(["model.n_layers=2"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--train.steps"])
    no_value = r"--train.steps has no value \(next: '--train.run_dir=x'; a value that starts"
    with pytest.raises(ConfigError, match=no_value):
        parse_overrides(["--train.steps", "--train.run_dir=x"])
    assert parse_overrides(["--optim.lr", "-1"]) == {"optim.lr": -1}  # a value, refused later
    with pytest.raises(
        ConfigError, match=r"train.run_dir must be a string, got nothing \(an empty"
    ):
        load_config(CONFIGS / "ar.yaml", ["--train.run_dir= "])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["--train.steps.x=1"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent.yaml")


def test_save_and_reload_round_trip(tmp_path):
    cfg = load_config(CONFIGS / "ar.yaml", ["--train.steps=123"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    assert not list(tmp_path.glob("*.tmp"))


def test_a_config_written_with_execution_fields_under_model_still_loads(tmp_path):
    """Run dirs and presets of earlier versions held kernels, dtypes, dropout ... in `model`:
    they move to `execution` on load; set in both places, it is an error naming them."""
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  n_layers: 2\n  dropout: 0.1\n  kernels: xla\n")
    cfg = load_config(old, ["--execution.remat=block"])
    assert cfg.model.n_layers == 2 and cfg.execution.dropout == 0.1
    assert cfg.execution.remat == "block"
    both = tmp_path / "both.yaml"
    both.write_text("model:\n  dropout: 0.1\nexecution:\n  dropout: 0.2\n")
    with pytest.raises(ConfigError, match=r"\['dropout'\] set in both model and execution"):
        load_config(both)
