"""`specdec generate`: streamed text, summary line, --json, clear errors."""

import json

import pytest
from fixtures import tiny_pair

from specdec.cli import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("cli"))


@pytest.mark.slow
def test_generate_streams_and_summarises(pair, capsys):
    rc = main(["generate", "def fib(n):", "--model", str(pair), "--draft", str(pair),
               "--max-tokens", "12", "--max-model-len", "64", "--ignore-eos"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("def fib(n):")
    last = out.strip().splitlines()[-1]
    assert last.startswith("[12 tokens, ") and "tokens/s" in last
    assert "acceptance length" in last and "acceptance rate" in last


def test_generate_json_matches_api(pair, capsys):
    from specdec import LLM, SamplingParams

    argv = ["generate", "class Point:", "--model", str(pair), "--method", "ngram"]
    rc = main(argv + ["--max-tokens", "10", "--max-model-len", "64", "--json", "--ignore-eos"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    llm = LLM(pair, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = llm.generate(["class Point:"], params, use_tqdm=False)
    assert result["token_ids"] == ref[0].outputs[0].token_ids
    assert result["text"] == ref[0].outputs[0].text
    assert result["num_tokens"] == 10 and result["method"] == "ngram"


def test_a_model_without_a_draft_runs_ngram_and_says_so(pair, capsys):
    argv = ["generate", "class Point:", "--model", str(pair), "--max-tokens", "6",
            "--max-model-len", "64", "--json", "--ignore-eos"]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["method"] == "ngram" and json.loads(out)["num_tokens"] == 6
    notes = [x for x in err.splitlines() if "n-gram prompt lookup" in x]
    assert notes == ["specdec: no --draft given: drafting with n-gram prompt lookup "
                     "(--method ngram); --method none decodes without speculation"]  # fmt: skip
    assert main(argv + ["--method", "none"]) == 0  # plain decoding: no note
    out, err = capsys.readouterr()
    assert json.loads(out)["method"] == "none" and "n-gram" not in err


def test_generate_bad_input_is_a_clear_error(pair, capsys):
    rc = main(["generate", "x", "--model", str(pair), "--method", "none", "--top-p", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "top_p must be in (0, 1], got 2.0." in err
    rc = main(["generate", "x", "--model", str(pair / "missing")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    rc = main(["generate", "x", "--model", str(pair), "--method", "draft_model"])
    assert rc == 2 and "needs --draft" in capsys.readouterr().err
    rc = main(["generate", "x", "--model", str(pair), "--method", "ngram", "--draft", str(pair)])
    assert rc == 2 and "--method ngram takes none" in capsys.readouterr().err
    rc = main(["generate", "x", "--model", str(pair), "--tensor-parallel-size", "64"])
    assert rc == 2 and "tensor_parallel_size=64 needs that many local devices" in (
        capsys.readouterr().err
    )


def test_sampling_flags_over_generation_config_over_cli_defaults(tmp_path):
    import argparse
    import json

    from specdec.flags import add_sampling_arguments, sampling_from_args

    p = argparse.ArgumentParser()
    add_sampling_arguments(p)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "repetition_penalty": 1.2})
    )

    def params(*argv):
        args = p.parse_args(list(argv))
        args.model = str(tmp_path)
        return sampling_from_args(args)

    got = params()
    assert (got.temperature, got.repetition_penalty, got.top_p) == (0.6, 1.2, 1.0)
    got = params("--temperature", "0", "--repetition-penalty", "1")
    assert (got.temperature, got.repetition_penalty) == (0.0, 1.0)
    (tmp_path / "generation_config.json").unlink()
    assert params().temperature == 0.0  # the CLI's own default: greedy
