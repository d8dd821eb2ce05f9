"""The official OpenAI Python SDK resuming background responses (tests/api/resume.rs drives it).

One JSON command a line on stdin, run concurrently; one JSON line on stdout per command, with its id:

- {"id", "op": "session", "base", "run", "query", "disconnects": [k, ...]}: follows run `run` of the thread whose path is
  `base` (the client's base_url) with `responses.retrieve(run, stream=True, starting_after=last)`, disconnecting
  after k events of each stream in turn, resuming after the last sequence number it saw, until
  `response.completed`. Every event
  is the SDK's typed event (strict validation); each stream's sequence numbers must follow the cursor without a gap
  or a repeat. A text block whose deltas disagree with its `output_text.done` (resumed after a cursor across a
  rewrite of earlier text) is replayed whole. Answers {"parts": [{"text"} | {"question"}], "status", "streams",
  "disconnects", "replays"}.
- {"id", "op": "boundary", "base", "run", "query"}: the run replayed whole, then from every cursor: each must be exactly the
  events after it. Answers {"events": n}.

`query` is the read's identity (`agent_class`, `agent_id`), sent as the SDK's extra query. A run not there yet
(404) is asked for again. Errors answer {"id", "error"}.
"""

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai

write_lock = threading.Lock()


def client(base):
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, _strict_response_validation=True)


def retrieve(sdk, run, query, **kwargs):
    """The stream of `run` (with the read's identity, `query`), asking again while the run is not there yet (its
    first event not applied)."""
    for _ in range(1000):
        try:
            return sdk.responses.retrieve(run, stream=True, extra_query=query, **kwargs)
        except openai.NotFoundError:
            time.sleep(0.02)
    raise RuntimeError(f"{run}: never found")


class Assembly:
    """A response's output as a client assembles it from the events."""

    def __init__(self):
        self.items = {}
        self.order = []
        self.status = None

    def apply(self, event):
        kind = event.type
        if kind == "response.output_item.added":
            item = event.item
            if item.id not in self.items:
                self.order.append(item.id)
            if item.type == "message":
                self.items[item.id] = {"text": ""}
            else:
                self.items[item.id] = {"question": json.loads(item.arguments)["question"]}
        elif kind == "response.output_text.delta":
            if event.item_id not in self.items:
                # An item this client never saw added: it resumed after a cursor the run renumbered.
                return False
            self.items[event.item_id]["text"] += event.delta
        elif kind == "response.output_text.done":
            # The block's whole text: deltas assembled across a rewrite of earlier text (a resume after a cursor
            # the run renumbered) disagree with it, and the client replays the run whole.
            return event.item_id in self.items and self.items[event.item_id]["text"] == event.text
        elif kind == "response.completed":
            self.status = event.response.status
            output = [item for item in event.response.output]
            if [item.id for item in output] != self.order:
                return False
            texts = [item.content[0].text for item in output if item.type == "message"]
            if texts != [self.items[i]["text"] for i in self.order if "text" in self.items[i]]:
                return False
        return True

    def parts(self):
        return [self.items[item] for item in self.order]


def session(command):
    sdk = client(command["base"])
    disconnects = list(command.get("disconnects", []))
    assembly = Assembly()
    last = None
    streams = 0
    cut = 0
    replays = 0
    while True:
        streams += 1
        if streams > 200:
            raise RuntimeError("no end after 200 streams")
        kwargs = {} if last is None else {"starting_after": last}
        stream = retrieve(sdk, command["run"], command.get("query"), **kwargs)
        seen = 0
        completed = False
        aborted = False
        replayed = False
        for event in stream:
            expected = 0 if last is None else last + 1
            if event.sequence_number != expected:
                raise AssertionError(f"sequence {event.sequence_number} after {last}")
            if not assembly.apply(event):
                replays += 1
                replayed = True
                stream.close()
                break
            last = event.sequence_number
            seen += 1
            if event.type == "response.completed":
                completed = True
            if disconnects and seen >= disconnects[0]:
                disconnects.pop(0)
                stream.close()
                aborted = True
                cut += 1
                break
        if completed:
            return {
                "parts": assembly.parts(),
                "status": assembly.status,
                "streams": streams,
                "disconnects": cut,
                "replays": replays,
            }
        if replayed:
            # The deltas disagreed with a block's whole text: the run was renumbered; replay it from the start.
            assembly = Assembly()
            last = None
        elif seen == 0 and not aborted:
            # Nothing new (the run waits for its question's answer): the client's pace before it asks again.
            time.sleep(0.02)


def boundary(command):
    sdk = client(command["base"])
    query = command.get("query")
    whole = [event.to_dict() for event in retrieve(sdk, command["run"], query)]
    if [e["sequence_number"] for e in whole] != list(range(len(whole))):
        raise AssertionError("the replay's sequence numbers are not 0, 1, ...")
    for cursor in range(len(whole) + 1):
        after = [event.to_dict() for event in retrieve(sdk, command["run"], query, starting_after=cursor)]
        if after != whole[cursor + 1 :]:
            raise AssertionError(f"after {cursor}: {len(after)} events, not the {len(whole[cursor + 1:])} after it")
    return {"events": len(whole)}


def handle(line):
    command = json.loads(line)
    try:
        op = {"session": session, "boundary": boundary}[command["op"]]
        reply = {"id": command["id"], **op(command)}
    except Exception as error:  # noqa: BLE001 - every failure is the test's answer
        reply = {"id": command["id"], "error": f"{type(error).__name__}: {error}"}
    with write_lock:
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def main():
    with ThreadPoolExecutor(max_workers=64) as pool:
        for line in sys.stdin:
            if line.strip():
                pool.submit(handle, line)


if __name__ == "__main__":
    main()
