// A pooled HTTP client through a rolling restart: Node's fetch (undici, its keep-alive pool), which does not retry,
// GETs `url` every 1/`rate` s until a line `stop` arrives on stdin. Prints `ready` after its first answer, then
// `undici <answers> <failures> <first failure>`.
import { createInterface } from "node:readline";

const [url, rate] = [process.argv[2], Number(process.argv[3])];
let stopped = false;
let [answers, failures, first] = [0, 0, "-"];
createInterface({ input: process.stdin }).on("line", (line) => {
  if (line.trim() === "stop") stopped = true;
});
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
let ready = false;
while (!stopped) {
  const began = performance.now();
  try {
    const response = await fetch(url);
    await response.arrayBuffer();
    if (response.status === 200) answers += 1;
    else {
      failures += 1;
      if (first === "-") first = `status_${response.status}`;
    }
  } catch (error) {
    failures += 1;
    if (first === "-") first = (error.cause?.code ?? error.name).replace(/ /g, "_");
  }
  if (!ready) {
    ready = true;
    console.log("ready");
  }
  await sleep(Math.max(0, 1000 / rate - (performance.now() - began)));
}
console.log(`undici ${answers} ${failures} ${first}`);
process.exit(0);
