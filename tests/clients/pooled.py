"""Pooled HTTP clients through a rolling restart: httpx (the OpenAI SDK's client, httpx2 here) and urllib3, one
pooled connection each, GET `url` every 1/`rate` s from their own threads until a line `stop` arrives on stdin;
neither retries. Prints `ready` once each had an answer, then at the end one line per client:
`<name> <answers> <failures> <first failure>`."""

import sys
import threading
import time

import httpx2
import urllib3

url, rate = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
results = {}
ready = threading.Barrier(3)


def run(name, get):
    answers, failures, first = 0, 0, "-"
    started = False
    while not stop.is_set():
        began = time.monotonic()
        try:
            status = get()
            if status == 200:
                answers += 1
            else:
                failures += 1
                first = first if failures > 1 else f"status {status}"
        except Exception as error:  # every failure counts, whatever its kind
            failures += 1
            first = first if failures > 1 else type(error).__name__
        if not started:
            started = True
            ready.wait()
        time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - began)))
    results[name] = (answers, failures, first)


httpx_client = httpx2.Client(limits=httpx2.Limits(max_connections=1, max_keepalive_connections=1), timeout=10)
pool = urllib3.PoolManager(maxsize=1, block=True, retries=False, timeout=10)
threads = [
    threading.Thread(target=run, args=("httpx", lambda: httpx_client.get(url).status_code)),
    threading.Thread(target=run, args=("urllib3", lambda: pool.request("GET", url).status)),
]
for thread in threads:
    thread.start()
ready.wait()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "stop":
        break
stop.set()
for thread in threads:
    thread.join()
for name, (answers, failures, first) in sorted(results.items()):
    print(name, answers, failures, first.replace(" ", "_"), flush=True)
