"""Calls chat-history-view through the official OpenAI Python SDK with its DEFAULT retries (max_retries left as the
SDK sets it), to show which error answers the SDK sends again. The Rust test (tests/api/sdk.rs) counts the requests
the worker received; this script only reports what the SDK saw.

Usage: python retries.py <base_url> <thread> <call>...

Calls (each on <thread>): too_large and bad_request list the items (the second with a limit out of range),
not_found retrieves the conversation, method_not_allowed deletes it, overloaded lists the items. It prints one JSON
document on stdout: {"max_retries": <the SDK's default>, "<call>": {"status": <HTTP status or null>, "code":
<the error code or null>}}.
"""

import json
import sys

import openai


def call(client: openai.OpenAI, name: str, thread: str) -> None:
    if name in ("too_large", "overloaded"):
        client.conversations.items.list(thread)
    elif name == "bad_request":
        client.conversations.items.list(thread, limit=100000)
    elif name == "not_found":
        client.conversations.retrieve(thread)
    elif name == "method_not_allowed":
        client.conversations.delete(thread)
    else:
        raise SystemExit(f"unknown call {name}")


def main() -> None:
    base_url, thread, calls = sys.argv[1], sys.argv[2], sys.argv[3:]
    # No max_retries: the SDK's default is what clients run with.
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    report = {"max_retries": client.max_retries}
    for name in calls:
        try:
            call(client, name, thread)
            report[name] = {"status": 200, "code": None}
        except openai.APIStatusError as error:
            body = error.body if isinstance(error.body, dict) else {}
            # The SDK hands over the body's `error` object, or the whole body.
            detail = body.get("error", body) if isinstance(body, dict) else {}
            report[name] = {"status": error.status_code, "code": detail.get("code")}
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
