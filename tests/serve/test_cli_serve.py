"""`pixeltriage serve` and `bench serve` flags: every bad value or combination is a one-line usage error (exit 2)
before anything is imported or loaded."""
import pytest

from pixeltriage.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["--port", "70000"], "--port: must be a port number"),
    (["--max-queued", "0"], "--max-queued: must be at least 1"),
    (["--max-wait-ms", "-1"], "--max-wait-ms: must be a number >= 0"),
    (["--max-wait-ms", "nan"], "--max-wait-ms: must be a number >= 0"),
    (["--request-timeout", "0"], "--request-timeout: must be a number > 0"),
    (["--payload-limit", "inf"], "--payload-limit: must be a number > 0"),
    (["--image-root", "{tmp}/none"], "no such directory"),
    (["--api-key-file", "{tmp}/none"], "no such file"),
    (["--api-key-file", "{empty}"], "holds no API key"),
    (["--cache", "{file}/c.db"], "is not a directory"),
    (["--max-client-batch", "64", "--max-queued", "8"], "above --max-queued 8"),
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray", "--replicas", "2", "--max-replicas", "4"], "--replicas is a fixed count"),
    (["--ray", "--min-replicas", "5", "--max-replicas", "4"], "--min-replicas 5 is above --max-replicas 4"),
    (["--ray", "--gpus-per-replica", "0.5"], "--gpus-per-replica needs --device cuda"),
    (["--ray", "--gpus-per-replica", "1.5", "--device", "cuda"], "--gpus-per-replica: must be in (0, 1]"),
    (["--max-replicas-per-node", "1"], "--max-replicas-per-node needs --ray"),
    (["--ray", "--max-replicas-per-node", "0"], "--max-replicas-per-node: must be at least 1"),
])
def test_serve_usage_errors(argv, needle, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").write_text("\n  \n")
    values = {"tmp": tmp_path, "file": tmp_path / "file", "empty": tmp_path / "empty"}
    monkeypatch.setattr("pixeltriage.engine.scorer.Scorer.load", lambda *a, **k: pytest.fail("loaded a model"))
    try:
        code = main(["serve", "--checkpoint", str(tiny_checkpoint), *(a.format(**values) for a in argv)])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and needle in err, err
    assert err.strip().splitlines()[-1].startswith(("error:", "pixeltriage serve: error:")), err


@pytest.mark.parametrize("argv, needle", [
    (["--clients", "0"], "--clients: must be at least 1"),
    (["--rate", "-3"], "--rate: must be a number > 0"),
    (["--max-wait-ms", "-1"], "--max-wait-ms: must be a number >= 0"),
])
def test_bench_serve_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [([], 32), (["--max-queued", "1"], 1), (["--max-queued", "8"], 8),
                                            (["--max-queued", "8", "--max-client-batch", "3"], 3)])
def test_max_client_batch_defaults_to_at_most_max_queued(argv, expected, tiny_checkpoint):
    import argparse

    from pixeltriage.cli.serve import add_serve_arguments, check_serve_arguments, serve_config

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--checkpoint", str(tiny_checkpoint), *argv])
    check_serve_arguments(args)
    config = serve_config(args)
    assert config.max_client_batch == expected and config.max_queued == (int(argv[1]) if argv else 256)


@pytest.mark.parametrize("argv, expected", [([], 1.0), (["--trim-idle-s", "5"], 5.0), (["--trim-idle-s", "0"], None)])
def test_trim_idle_s_reaches_the_config_and_zero_turns_it_off(argv, expected, tiny_checkpoint):
    import argparse

    from pixeltriage.cli.serve import DEFAULTS, add_serve_arguments, check_serve_arguments, serve_config
    from pixeltriage.serve.config import ServeConfig

    assert DEFAULTS["trim_idle_s"] == ServeConfig().trim_idle_s     # the flag's default is the library's
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--checkpoint", str(tiny_checkpoint), *argv])
    check_serve_arguments(args)
    assert serve_config(args).trim_idle_s == expected
