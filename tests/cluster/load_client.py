"""A load client of the cluster tests, run as its own process (in the head's namespace): `--threads` closed loops
post the questions of `--bodies` (a JSON list of /v1/score bodies, taken in turn) to `--url`, each request with an
id of its own (`r<n>`) and the Bearer key of `--api-key-file`, until the file `--stop` appears or `--duration` s have passed.

A request is retried, with the same id, after a 503 or 429 (after its Retry-After, at most MAX_WAIT s) and after a
connection failure (RETRY_PAUSE s later), until it is answered otherwise or REQUEST_DEADLINE s have passed; once
`--stop` exists no new request starts and no refused one is retried. Every attempt is one line of `--out` (JSON):
request id, body index, attempt number, sent and answered on the monotonic clock (the machine's, shared with the
test process), status (or the error's type), Retry-After, the echoed id and the scores; the test judges them."""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

import httpx

MAX_WAIT = 5.0
RETRY_PAUSE = 0.5
REQUEST_DEADLINE = 120.0
RETRIED = (429, 503)


def one_request(client: httpx.Client, url: str, rid: str, index: int, body: dict, stop: str, record) -> None:
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        sent = time.monotonic()
        entry = {"id": rid, "body": index, "attempt": attempt, "sent": sent}
        try:
            response = client.post(url, json={**body, "id": rid})
        except httpx.HTTPError as e:
            entry.update(answered=time.monotonic(), status=type(e).__name__, error=str(e)[:300])
            record(entry)
            if os.path.exists(stop) or time.monotonic() - started > REQUEST_DEADLINE:
                return
            time.sleep(RETRY_PAUSE)
            continue
        entry.update(answered=time.monotonic(), status=response.status_code,
                     retry_after=response.headers.get("retry-after"))
        if response.status_code == 200:
            answer = response.json()
            entry.update(echoed=answer.get("id"), p_vis=answer["p_vis"], gains=answer["gains"],
                         relevance=answer["relevance"], relevance_none=answer["relevance_none"])
        else:
            entry["error"] = response.text[:300]
        record(entry)
        if response.status_code not in RETRIED or os.path.exists(stop) \
                or time.monotonic() - started > REQUEST_DEADLINE:
            return
        try:
            wait = float(response.headers.get("retry-after", RETRY_PAUSE))
        except ValueError:
            wait = RETRY_PAUSE
        time.sleep(min(MAX_WAIT, max(0.0, wait)))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--bodies", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--api-key-file", required=True)
    args = p.parse_args()
    with open(args.bodies) as f:
        bodies = json.load(f)
    with open(args.api_key_file) as f:
        headers = {"authorization": f"Bearer {f.read().strip()}"}
    lock = threading.Lock()
    counter = iter(range(10**9))
    out = open(args.out, "a", buffering=1)
    deadline = time.monotonic() + args.duration

    def record(entry: dict) -> None:
        with lock:
            out.write(json.dumps(entry) + "\n")

    def loop() -> None:
        with httpx.Client(timeout=REQUEST_DEADLINE, headers=headers) as client:
            while not os.path.exists(args.stop) and time.monotonic() < deadline:
                with lock:
                    n = next(counter)
                one_request(client, args.url, f"r{n}", n % len(bodies), bodies[n % len(bodies)], args.stop, record)

    threads = [threading.Thread(target=loop) for _ in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
