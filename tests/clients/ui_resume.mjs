// The Vercel AI SDK resuming chat streams, as a chat page does (tests/api/resume.rs drives it): its
// DefaultChatTransport's reconnectToStream (the request useChat's `resume: true` sends, pointed at the worker with
// prepareReconnectToStreamRequest), its chunk schemas, and readUIMessageStream assembling the message.
//
// One JSON command a line on stdin, handled concurrently: {"id", "url", "chat", "abort_after"?}: one resume of chat
// `chat` at `url` (the worker's ui-message-stream URL of that chat, query included), aborted (a disconnect) after
// `abort_after` message snapshots when given. One JSON line on stdout per command: {"id", "idle"} for a 204, else
// {"id", "message" (the last snapshot), "snapshots", "finish_reason", "finished", "aborted"}, or {"id", "error"}
// when the SDK refused a chunk or the request failed.

import { createRequire } from 'node:module';
import { join } from 'node:path';
import { createInterface } from 'node:readline';

const require = createRequire(join(process.env.NODE_CLIENTS_DIR, 'package.json'));
const { DefaultChatTransport, readUIMessageStream } = require('ai');

async function resume(command) {
  const controller = new AbortController();
  const transport = new DefaultChatTransport({
    api: 'http://unused.invalid/api/chat',
    prepareReconnectToStreamRequest: () => ({ api: command.url }),
  });
  const stream = await transport.reconnectToStream({
    chatId: command.chat,
    abortSignal: controller.signal,
  });
  if (stream === null) {
    return { idle: true };
  }
  // One branch assembles the message as useChat does, the other sees the chunks (the finish reason).
  const [forMessage, forChunks] = stream.tee();
  let finishReason = null;
  let finished = false;
  const reader = forChunks.getReader();
  const chunks = (async () => {
    try {
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        if (value.type === 'finish') {
          finished = true;
          finishReason = value.finishReason ?? null;
        }
      }
    } catch {
      // The abort below, seen by this branch too.
    }
  })();
  let message = null;
  let snapshots = 0;
  let aborted = false;
  try {
    for await (const snapshot of readUIMessageStream({ stream: forMessage, terminateOnError: true })) {
      message = snapshot;
      snapshots += 1;
      if (command.abort_after != null && snapshots >= command.abort_after) {
        aborted = true;
        controller.abort();
        break;
      }
    }
  } catch (error) {
    if (!aborted) throw error;
  }
  // A disconnected client reads no more: its chunk branch is cancelled, not drained.
  if (aborted) await reader.cancel().catch(() => {});
  await chunks;
  return { message, snapshots, finish_reason: finishReason, finished, aborted };
}

const lines = createInterface({ input: process.stdin });
const pending = [];
for await (const line of lines) {
  if (!line.trim()) continue;
  const command = JSON.parse(line);
  pending.push(
    resume(command)
      .then((result) => ({ id: command.id, ...result }))
      .catch((error) => ({ id: command.id, error: String(error?.stack ?? error) }))
      .then((reply) => process.stdout.write(JSON.stringify(reply) + '\n')),
  );
}
await Promise.all(pending);
