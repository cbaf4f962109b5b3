"""Background load for scripts/swarm-smoke.sh: greedy chat requests against the gateway.

`python3 scripts/swarm-load.py baseline URL OUT`: each prompt once, undisturbed; writes
{prompt index: text} to OUT.
`python3 scripts/swarm-load.py load URL OUT STOP_FILE`: WORKERS threads send requests
(alternately streamed and not, PAUSE_S apart) until STOP_FILE exists or MAX_REQUESTS were
sent; one JSON line per request in OUT.
`python3 scripts/swarm-load.py report BASELINE OUT [PHASES]`: counts, checks, exits 1 on a
failure. PHASES holds "START END NAME" lines (epoch seconds): the requests started in each.

Standard library only: it runs with the host's python3, outside the image.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

PROMPTS = [
    "Who is the current US president?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
]
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "12"))
WORKERS = int(os.environ.get("WORKERS", "4"))
MAX_REQUESTS = int(os.environ.get("MAX_REQUESTS", "1500"))
PAUSE_S = float(os.environ.get("PAUSE_S", "0.5"))
TIMEOUT_S = 120.0


def _request(url: str, prompt: int, stream: bool) -> urllib.request.Request:
    body = {"model": os.environ.get("SERVED_MODEL_NAME", "smollm2-135m-instruct"),
            "messages": [{"role": "user", "content": PROMPTS[prompt]}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    headers = {"content-type": "application/json"}
    if os.environ.get("SPECDEC_API_KEY"):
        headers["authorization"] = "Bearer " + os.environ["SPECDEC_API_KEY"]
    return urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                  headers=headers)


def ask(url: str, prompt: int, stream: bool) -> dict:
    """One request: {"ok": bool, "text", "error", "cut" (a stream ended by an error event)}."""
    started = time.time()
    result: dict = {"prompt": prompt, "stream": stream, "start": started, "ok": False,
                    "cut": False, "text": "", "error": ""}
    try:
        with urllib.request.urlopen(_request(url, prompt, stream), timeout=TIMEOUT_S) as reply:
            if not stream:
                result["text"] = json.load(reply)["choices"][0]["message"]["content"]
                result["ok"] = True
            else:
                done = False
                for raw in reply:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        # A stream the gateway ended with an error event (its verifier stopped).
                        result["cut"] = True
                        result["error"] = chunk["error"].get("message", str(chunk["error"]))
                        break
                    for choice in chunk.get("choices", []):
                        result["text"] += choice.get("delta", {}).get("content") or ""
                result["ok"] = done
                if not done and not result["cut"]:
                    result["error"] = "stream closed without [DONE] or an error event"
    except urllib.error.HTTPError as err:
        result["error"] = f"HTTP {err.code}: {err.read().decode(errors='replace')[:300]}"
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
    result["seconds"] = round(time.time() - started, 3)
    return result


def baseline(url: str, out: str) -> None:
    texts = {}
    for index in range(len(PROMPTS)):
        result = ask(url, index, stream=False)
        if not result["ok"]:
            sys.exit(f"baseline request failed: {result['error']}")
        texts[index] = result["text"]
    with open(out, "w") as f:
        json.dump(texts, f)


def load(url: str, out: str, stop_file: str) -> None:
    lock = threading.Lock()
    sent = [0]

    def worker(offset: int) -> None:
        turn = offset
        while not os.path.exists(stop_file):
            with lock:
                if sent[0] >= MAX_REQUESTS:
                    return
                sent[0] += 1
            result = ask(url, turn % len(PROMPTS), stream=bool(turn % 2))
            turn += 1
            with lock, open(out, "a") as f:
                f.write(json.dumps(result) + "\n")
            time.sleep(PAUSE_S)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def report(baseline_file: str, out: str, phases_file: str | None = None) -> int:
    with open(baseline_file) as f:
        expected = {int(k): v for k, v in json.load(f).items()}
    with open(out) as f:
        results = [json.loads(line) for line in f if line.strip()]
    ok = [r for r in results if r["ok"]]
    cut = [r for r in results if r["cut"]]
    failed = [r for r in results if not r["ok"] and not r["cut"]]
    differ = [r for r in ok if r["text"] != expected[r["prompt"]]]
    seconds = sorted(r["seconds"] for r in ok) or [0.0]
    print(f"load: {len(results)} requests ({sum(r['stream'] for r in results)} streamed), "
          f"{len(ok)} ok, {len(failed)} failed, {len(cut)} streams cut with an error event; "
          f"latency median {seconds[len(seconds) // 2]:.2f} s, max {seconds[-1]:.2f} s")
    for r in cut[:5]:
        print(f"  cut stream (prompt {r['prompt']}): {r['error']}")
    for r in failed[:10]:
        print(f"  FAILED (prompt {r['prompt']}, stream={r['stream']}, at {r['start']:.0f}): {r['error']}")
    if phases_file:
        with open(phases_file) as f:
            for line in f:
                start, end, name = line.split(maxsplit=2)
                during = [r for r in results if float(start) <= r["start"] <= float(end)]
                print(f"  during {name.strip()}: {len(during)} requests, "
                      f"{sum(not r['ok'] for r in during)} not ok")
    print(f"greedy outputs identical to the undisturbed baseline: {len(ok) - len(differ)}/{len(ok)}")
    for r in differ[:5]:
        print(f"  DIFFERS (prompt {r['prompt']}): {r['text']!r} != {expected[r['prompt']]!r}")
    return 1 if failed or differ or not ok else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["baseline"] and len(argv) == 3:
        baseline(argv[1], argv[2])
        return 0
    if argv[:1] == ["load"] and len(argv) == 4:
        load(argv[1], argv[2], argv[3])
        return 0
    if argv[:1] == ["report"] and len(argv) in (3, 4):
        return report(*argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
