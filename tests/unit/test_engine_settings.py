"""The engine's plain settings are declared once, as rows beside EngineParams (cpp/engine_params.cpp): the binding
of each field, Llama's keyword check, the CLI's flags and the README's table follow from the rows, and these tests
hold each of them to the rows."""
import argparse
import inspect
import re
from pathlib import Path

from h2o_local import Llama, _engine
from h2o_local.cli.common import CLI_ENGINE_DEFAULTS, add_model_args, engine_kwargs

ROOT = Path(__file__).resolve().parents[2]
ROWS = _engine.ENGINE_SETTINGS


def test_every_row_is_a_field_of_engine_params_with_its_default():
    params = _engine.EngineParams()
    for row in ROWS:
        assert getattr(params, row["name"]) == row["default"], row["name"]
        if isinstance(row["default"], bool):
            assert row["minimum"] is None and row["unit"] == ""
        else:
            setattr(params, row["name"], 7)
            assert getattr(params, row["name"]) == 7 and row["unit"], row["name"]


def test_llamas_signature_has_every_row_with_the_engines_default():
    """Llama's explicit signature (for editors) spells each setting: the same name and default as its row."""
    params = inspect.signature(Llama.__init__).parameters
    for row in ROWS:
        assert row["name"] in params, f"Llama has no keyword {row['name']}"
        assert params[row["name"]].default == row["default"], row["name"]


def test_the_readme_table_has_every_row_with_its_default():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("Keyword arguments of `Llama(model_path, ...)`:", 1)[1].split("\n\n", 2)[1]
    for row in ROWS:
        line = next((r for r in table.splitlines() if f"`{row['name']}`" in r.split("|")[1]), None)
        assert line is not None, f"README's keyword table has no row for {row['name']}"
        assert f"`{row['default']!r}`" in line.split("|")[2], (row["name"], line)


def parser():
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    return ap


def test_the_cli_has_each_rows_flags_and_passes_what_they_say():
    ap = parser()
    for row in ROWS:
        for flag in row["flags"]:  # each flag sets the row's keyword
            if isinstance(row["default"], bool):
                assert getattr(ap.parse_args([flag]), row["name"]) is True, flag
            else:
                assert getattr(ap.parse_args([flag, "5"]), row["name"]) == 5, flag
    args = ap.parse_args([])
    given = engine_kwargs(args)
    for row in ROWS:
        if row["flags"] and row["name"] != "n_ctx":  # -c sizes the full cache: not given unless set
            assert given[row["name"]] == CLI_ENGINE_DEFAULTS.get(row["name"], row["default"]), row["name"]
    assert "n_ctx" not in given
    ints = [row for row in ROWS if row["flags"] and not isinstance(row["default"], bool)]
    argv = [x for row in ints for x in (row["flags"][0], "3")] + ["--no-position-rolling"]
    given = engine_kwargs(ap.parse_args(argv))
    assert all(given[row["name"]] == 3 for row in ints) and given["position_rolling"] is False


def test_llamas_check_refuses_a_value_outside_a_rows_range(tiny_model):
    import pytest

    for row in ROWS:
        if row["minimum"] is not None:
            with pytest.raises(ValueError, match=re.escape(row["name"])):
                Llama(tiny_model, **{row["name"]: row["minimum"] - 1})
        if row["maximum"] is not None:
            with pytest.raises(ValueError, match=re.escape(row["name"]) + ".*<= " + str(row["maximum"])):
                Llama(tiny_model, **{row["name"]: row["maximum"] + 1})
        elif isinstance(row["default"], bool):
            with pytest.raises(TypeError, match=re.escape(row["name"])):
                Llama(tiny_model, **{row["name"]: "yes"})


def test_n_threads_batch_is_one_field_and_one_row_and_reaches_llama_cpp(tiny_model):
    """The setting added as the rows say (a field, a row, Llama's keyword): prompts get their own threads, as
    llama.cpp's -tb; 0 means the generation's."""
    assert [r["flags"] for r in ROWS if r["name"] == "n_threads_batch"] == [["-tb", "--threads-batch"]]
    assert engine_kwargs(parser().parse_args(["-tb", "2"]))["n_threads_batch"] == 2
    llm = Llama(tiny_model, n_threads=1, n_threads_batch=2)
    assert (llm.n_threads, llm.n_threads_batch) == (1, 2)
    same = Llama(tiny_model, n_threads=1)
    assert (same.n_threads, same.n_threads_batch) == (1, 1)
