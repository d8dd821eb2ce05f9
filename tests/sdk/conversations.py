"""Drives chat-history-view's Conversations endpoints with the official OpenAI Python SDK (strict response
validation on), as a client of aihub's OpenAI-compatible endpoint would.

Usage: python conversations.py <base_url> <threads.json>

threads.json: [{"thread": ..., "query": {...extra query parameters...}}, ...]. For every thread it lists the items
with the SDK's auto-pagination in both orders and several limits, and retrieves the conversation. It prints one JSON
document on stdout: {"<thread>": {"lists": {"<order>/<limit>": [items...]}, "conversation": {...} or
{"error": <status>}}}. The Rust test compares it with the history; this script only reports what the SDK read.
"""

import json
import sys

import openai

# (order, limit): None leaves the parameter out (the API's defaults: desc, 20).
WALKS = [(None, None), ("asc", 1), ("desc", 3), ("asc", 20), ("desc", 100)]


def main() -> None:
    base_url, threads_file = sys.argv[1], sys.argv[2]
    with open(threads_file, encoding="utf-8") as f:
        threads = json.load(f)
    # The SDK's default retries, as clients run it: an error answer it would send again shows in the request counts
    # (tests/sdk/retries.py counts them).
    client = openai.OpenAI(base_url=base_url, api_key="unused", _strict_response_validation=True)
    report = {}
    for entry in threads:
        thread, query = entry["thread"], entry.get("query") or {}
        lists = {}
        for order, limit in WALKS:
            params = {}
            if order is not None:
                params["order"] = order
            if limit is not None:
                params["limit"] = limit
            page = client.conversations.items.list(thread, extra_query=query, **params)
            # Iterating a page fetches the following ones (`after` = the last item's id) while `has_more`.
            lists[f"{order or 'default'}/{limit or 'default'}"] = [
                item.model_dump(mode="json", exclude_none=True) for item in page
            ]
        try:
            conversation = client.conversations.retrieve(thread, extra_query=query).model_dump(mode="json")
        except openai.NotFoundError as error:
            conversation = {"error": error.status_code}
        report[thread] = {"lists": lists, "conversation": conversation}
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
