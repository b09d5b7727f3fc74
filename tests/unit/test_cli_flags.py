"""The command line takes llama.cpp's spellings (llama-cli's and llama-server's) of the settings it shares with them,
so that a command written for llama.cpp runs here as it is."""
import argparse

import pytest

from h2o_local.cli.common import add_model_args


def test_llama_cpp_s_short_flags_name_the_same_settings_as_the_long_ones():
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    short = ap.parse_args("-m x.gguf -t 3 -ngl 0 -fa on -ctk q8_0 -ctv q8_0 -b 64 -s 7".split())
    long = ap.parse_args("--model x.gguf --threads 3 --n-gpu-layers 0 --flash-attn on --cache-type-k q8_0 "
                         "--cache-type-v q8_0 --n-batch 64 --seed 7".split())
    assert vars(short) == vars(long) != vars(ap.parse_args([]))
    other = ap.parse_args(["--gpu-layers", "5", "--batch-size", "32", "-fa"])
    assert (other.n_gpu_layers, other.n_batch, other.flash_attn) == (5, 32, "on")


def test_llama_server_s_parallel_is_the_number_of_slots(capsys):
    from h2o_local.cli import main

    for flag in ("-np", "--parallel"):
        with pytest.raises(SystemExit) as e:
            main(["serve", flag, "0"])  # checked as --slots is, before anything loads
        assert e.value.code == 2 and "--slots" in capsys.readouterr().err
