/**
 * A Server-Sent Events parser (WHATWG HTML, "Interpreting an event stream"): lines end in
 * CRLF, LF or CR; `field: value` with one optional space after the colon; `data` lines
 * are joined with LF; a blank line dispatches the event; `:` starts a comment; an event
 * cut off by the end of the stream is dropped.
 */

/** One dispatched event. `id` is the last event id seen so far in the stream (as browsers keep it). */
export interface SseEvent {
  event: string;
  data: string;
  id: string | undefined;
}

/** Feeds text chunks in, returns the events each chunk completes. */
export class SseParser {
  #buffer = "";
  #pendingCr = false;
  #started = false;
  #event = "";
  #data: string[] = [];
  #hasData = false;
  #id: string | undefined;
  #retryMs: number | undefined;

  /** The id of the last event (`Last-Event-ID` to resume with). */
  get lastEventId(): string | undefined {
    return this.#id;
  }

  /** The reconnection time the stream asked for with `retry:`, in ms. */
  get retryMs(): number | undefined {
    return this.#retryMs;
  }

  push(chunk: string): SseEvent[] {
    if (!this.#started && chunk.length > 0) {
      this.#started = true;
      if (chunk.charCodeAt(0) === 0xfeff) chunk = chunk.slice(1);
    }
    if (chunk.length === 0) return [];
    // A CR at the end of the previous chunk already ended its line; a LF right after it belongs to it.
    if (this.#pendingCr && chunk.startsWith("\n")) chunk = chunk.slice(1);
    this.#pendingCr = false;
    this.#buffer += chunk;
    const out: SseEvent[] = [];
    let start = 0;
    for (;;) {
      let end = -1;
      for (let i = start; i < this.#buffer.length; i++) {
        const c = this.#buffer.charCodeAt(i);
        if (c === 0x0a || c === 0x0d) {
          end = i;
          break;
        }
      }
      if (end < 0) break;
      const line = this.#buffer.slice(start, end);
      let next = end + 1;
      if (this.#buffer.charCodeAt(end) === 0x0d) {
        if (next === this.#buffer.length) this.#pendingCr = true;
        else if (this.#buffer.charCodeAt(next) === 0x0a) next++;
      }
      start = next;
      const ev = this.#line(line);
      if (ev) out.push(ev);
    }
    this.#buffer = this.#buffer.slice(start);
    return out;
  }

  #line(line: string): SseEvent | undefined {
    if (line === "") return this.#dispatch();
    if (line.startsWith(":")) return undefined;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    switch (field) {
      case "event":
        this.#event = value;
        break;
      case "data":
        this.#data.push(value);
        this.#hasData = true;
        break;
      case "id":
        if (!value.includes("\0")) this.#id = value;
        break;
      case "retry":
        if (/^[0-9]+$/.test(value)) this.#retryMs = Number(value);
        break;
      default:
        break;
    }
    return undefined;
  }

  #dispatch(): SseEvent | undefined {
    const ev: SseEvent | undefined = this.#hasData
      ? { event: this.#event || "message", data: this.#data.join("\n"), id: this.#id }
      : undefined;
    this.#event = "";
    this.#data = [];
    this.#hasData = false;
    return ev;
  }
}

/** The events of a `text/event-stream` body, decoded as UTF-8. */
export async function* readSse(body: ReadableStream<Uint8Array>, parser = new SseParser()): AsyncGenerator<SseEvent> {
  const decoder = new TextDecoder("utf-8");
  const reader = body.getReader();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      yield* parser.push(decoder.decode(value, { stream: true }));
    }
    yield* parser.push(decoder.decode());
  } finally {
    await reader.cancel().catch(() => {});
  }
}
