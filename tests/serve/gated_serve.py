"""`pixeltriage serve` with gates its test holds: the real command line, server and service, with the model's load
and the batcher's forwards held shut until the test opens them, so that a test holding requests in flight depends
on no sleep and on no work taking long enough.

    python gated_serve.py CONTROL FORWARDS DONE HOLD serve [serve arguments ...]

CONTROL: a FIFO the test writes commands to, one per line: "open load", "open forward" (the gate opens), "close
forward" (it shuts again: the next forward to begin waits), "close batcher" (the batcher's threads stop, as if they
had died). DONE: a file each command is appended to once it took effect, so that the test can wait for it. When the
test's end closes, every gate opens: a failed test leaves no server waiting. FORWARDS: a file each forward appends
"<states> <tokens>" to as it begins (the warm-up's too). HOLD: the gates shut at start, comma-separated ("load",
"forward"), or "none". Only the batcher's forwards wait at the forward gate; the warm-up runs at load.

The process ends with os._exit once the command returns: an exit through the interpreter's finalization would close
a cache the server left open (SQLite then removes its -wal file), hiding the leak a test looks for.
"""
import os
import sys
import threading

from pixeltriage.engine.scorer import Scorer
from pixeltriage.serve import server
from pixeltriage.serve.service import ModelSpec

GATES = ("load", "forward")
BATCHER_WORKER = "pixeltriage-forward"       # the batcher's model worker thread (pixeltriage/serve/batcher.py)


class Control:
    def __init__(self, fifo: str, done: str, hold: set[str]):
        self.done = done
        self.gates = {name: threading.Event() for name in GATES}
        for name in set(GATES) - hold:
            self.gates[name].set()
        self.service = None
        self.has_service = threading.Event()
        threading.Thread(target=self._read, args=(fifo,), name="gated-serve-control", daemon=True).start()

    def wait(self, gate: str) -> None:
        self.gates[gate].wait()

    def _read(self, fifo: str) -> None:
        with open(fifo) as commands:             # the test opened its end before starting this process
            for line in commands:
                if self._run(line.split()):
                    with open(self.done, "a") as done:
                        done.write(line)
        for gate in self.gates.values():         # the test's end closed
            gate.set()

    def _run(self, command: list[str]) -> bool:
        """Whether the command was one of the above (an unknown one is reported, and never marked done)."""
        if command[:1] == ["open"] and command[1:] and command[1] in self.gates:
            self.gates[command[1]].set()
        elif command == ["close", "forward"]:
            self.gates["forward"].clear()
        elif command == ["close", "batcher"]:
            self.has_service.wait()
            self.service.batcher.close("closed by the test's control")
        else:
            print(f"gated_serve: unknown command {' '.join(command)!r}", file=sys.stderr, flush=True)
            return False
        return True


def install(control: Control, forwards: str) -> None:
    load, score_states, run = ModelSpec.load, Scorer.score_states, server.run

    def gated_load(spec):
        control.wait("load")
        return load(spec)

    def recorded_score_states(scorer, states):
        with open(forwards, "a") as out:
            out.write(f"{len(states)} {sum(s.num_tokens for s in states)}\n")
        if threading.current_thread().name == BATCHER_WORKER:
            control.wait("forward")
        return score_states(scorer, states)

    def captured_run(service, sock, **kwargs):
        control.service = service
        control.has_service.set()
        return run(service, sock, **kwargs)

    ModelSpec.load, Scorer.score_states, server.run = gated_load, recorded_score_states, captured_run


def main() -> None:
    fifo, forwards, done, hold, *args = sys.argv[1:]
    held = set() if hold == "none" else set(hold.split(","))
    if not held <= set(GATES):
        raise SystemExit(f"gated_serve: unknown gates {sorted(held - set(GATES))}")
    if args[:1] != ["serve"]:
        raise SystemExit(f"gated_serve: runs `serve` only, not {args[:1]}")
    install(Control(fifo, done, held), forwards)
    from pixeltriage.cli import main as command

    try:
        code = command(args)
    except SystemExit as e:                      # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
