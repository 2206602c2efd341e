"""Random input for the override parser and the config loader: a typed value or a ConfigError,
never another exception."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config import FIELD_TYPES, Config, ConfigError, check_type, parse_value, resolve

NAMES = sorted(FIELD_TYPES)
names = st.one_of(st.sampled_from(NAMES), st.text(max_size=20))
# text that often looks like a value: literals, near-literals, and arbitrary characters
value_texts = st.one_of(
    st.text(max_size=40),
    st.from_regex(r"-?[0-9]{0,20}(\.[0-9]*)?(e-?[0-9]{1,4})?", fullmatch=True),
    st.integers(min_value=-10**500, max_value=10**500).map(str),
    st.sampled_from(["true", "False", "None", "nan", "inf", "-inf", "1e999", "[1, 2]", "{'a': 1}",
                     "(", "''", "b'x'", "1j", "((((((((((((((((((((((((((((((1", "0x10", "1_000"]),
)
python_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)


def assert_typed(name, value):
    """The value is one the field's type allows, unchanged by a second check."""
    assert check_type(name, value) == value or value != value  # (nan never equals itself)


@settings(max_examples=400, deadline=None)
@given(name=names, text=value_texts)
def test_parse_value_returns_a_typed_value_or_raises_config_error(name, text):
    try:
        value = parse_value(name, text)
    except ConfigError:
        return
    assert_typed(name, value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(st.one_of(
    st.builds(lambda n, t: f"--{n}={t}", names, value_texts),
    st.builds(lambda n: f"--{n}", names),
    st.text(max_size=30)), max_size=5))
def test_resolve_returns_a_valid_config_or_raises_config_error(args, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))  # a random 'x.py' names no real file
    try:
        cfg = resolve(args)
    except ConfigError:
        return
    assert isinstance(cfg, Config)
    for field in dataclasses.fields(Config):
        assert_typed(field.name, getattr(cfg, field.name))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(assignments=st.lists(st.tuples(names, python_values), max_size=5),
       junk=st.one_of(st.just(""), st.text(max_size=30), st.sampled_from(
           ["1/0", "raise SystemExit(3)", "import nosuchmodule", "n_layer = ", "def f(:", "x = [",
            "assert False"])))
def test_config_files_load_or_raise_config_error(assignments, junk, tmp_path):
    lines = [f"{name} = {value!r}" for name, value in assignments if name.isidentifier()]
    path = tmp_path / "random_config.py"
    path.write_text("\n".join(lines + [junk]) + "\n")
    try:
        cfg = resolve([str(path)])
    except ConfigError as e:
        assert str(e)
        return
    assert isinstance(cfg, Config)


def test_a_config_file_that_exits_is_a_config_error(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("raise SystemExit(3)\n")
    with pytest.raises(ConfigError, match=r"exits\.py, line 1: SystemExit: 3"):
        resolve([str(path)])
