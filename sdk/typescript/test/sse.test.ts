import assert from "node:assert/strict";
import { test } from "node:test";

import { SseParser, readSse, type SseEvent } from "../src/index.js";

function parse(chunks: string[]): { events: SseEvent[]; parser: SseParser } {
  const parser = new SseParser();
  const events = chunks.flatMap((c) => parser.push(c));
  return { events, parser };
}

test("one event per blank line; id, data and the default type", () => {
  const { events, parser } = parse(['id: 1\ndata: {"seq":1}\n\nid: 2\ndata: {"seq":2}\n\n']);
  assert.deepEqual(events, [
    { event: "message", data: '{"seq":1}', id: "1" },
    { event: "message", data: '{"seq":2}', id: "2" },
  ]);
  assert.equal(parser.lastEventId, "2");
});

test("any split of the stream gives the same events, for LF, CRLF and CR line ends", () => {
  for (const eol of ["\n", "\r\n", "\r"]) {
    const text = [
      "\uFEFF: keep-alive",
      "retry: 250",
      "id: 7",
      "event: update",
      "data: line one",
      "data:line two",
      "",
      "data",
      "",
      "id: 8",
      "data: x",
      "",
      "",
    ].join(eol);
    const whole = parse([text]).events;
    assert.deepEqual(whole, [
      { event: "update", data: "line one\nline two", id: "7" },
      { event: "message", data: "", id: "7" },
      { event: "message", data: "x", id: "8" },
    ]);
    for (let i = 0; i <= text.length; i++) {
      for (const j of [i, Math.min(text.length, i + 1), Math.min(text.length, i + 3)]) {
        const { events, parser } = parse([text.slice(0, i), text.slice(i, j), text.slice(j)]);
        assert.deepEqual(events, whole, `${JSON.stringify(eol)} split at ${i}, ${j}`);
        assert.equal(parser.retryMs, 250);
      }
    }
  }
});

test("comments and unknown fields are ignored; an event cut off by the end is dropped", () => {
  const { events } = parse([": hi\nfoo: bar\ndata: a\n\ndata: b\n"]);
  assert.deepEqual(events, [{ event: "message", data: "a", id: undefined }]);
});

test("readSse decodes UTF-8 split inside a character", async () => {
  const bytes = new TextEncoder().encode("data: héllo €\n\n");
  const body = new ReadableStream<Uint8Array>({
    start(c) {
      for (const b of bytes) c.enqueue(new Uint8Array([b]));
      c.close();
    },
  });
  const out: SseEvent[] = [];
  for await (const e of readSse(body)) out.push(e);
  assert.deepEqual(out, [{ event: "message", data: "héllo €", id: undefined }]);
});
