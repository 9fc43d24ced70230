// The chat page: post a message, follow its events with EventSource, and paint the deltas at
// most once per animation frame. Text is appended as text nodes, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const log = $("log");
const prompt = $("prompt");
const history = [];
let current = null;

function csrfToken() {
  return document.querySelector("[name=csrfmiddlewaretoken]").value;
}

function postJSON(url, payload) {
  return fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
    body: JSON.stringify(payload),
    credentials: "same-origin",
  });
}

function atBottom() {
  return log.scrollHeight - log.scrollTop - log.clientHeight < 24;
}

function addTurn(role, text) {
  const turn = document.createElement("div");
  turn.className = `turn ${role}`;
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = text;
  turn.append(body);
  const follow = atBottom();
  log.append(turn);
  if (follow) log.scrollTop = log.scrollHeight;
  return turn;
}

function setStatus(text) {
  $("status").textContent = text;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

class ReplyStream {
  constructor(turn, sentAt) {
    this.turn = turn;
    this.body = turn.querySelector(".body");
    this.sentAt = sentAt;
    this.firstAt = null;
    this.tokens = 0;
    this.pending = "";
    this.text = "";
    this.frame = 0;
    this.finishReason = null;
  }

  open(url) {
    this.source = new EventSource(url);
    this.source.onmessage = (event) => this.onMessage(event.data);
    this.source.onerror = () => {
      if (this.source.readyState === EventSource.CLOSED) this.finish("the connection was closed");
    };
  }

  onMessage(data) {
    if (data === "[DONE]") return this.finish();
    const chunk = JSON.parse(data);
    if (chunk.error) return this.fail(chunk.error.message);
    if (chunk.choices.length === 0 && chunk.usage) return this.showUsage(chunk.usage);
    const choice = chunk.choices[0];
    if (chunk.usage && chunk.usage.completion_tokens) this.tokens = chunk.usage.completion_tokens;
    if (choice.delta.content) this.append(choice.delta.content);
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
  }

  append(text) {
    if (this.firstAt === null) this.firstAt = performance.now();
    this.pending += text;
    if (!this.frame) this.frame = requestAnimationFrame(() => this.flush());
  }

  flush() {
    this.frame = 0;
    if (this.pending) {
      const follow = atBottom();
      this.body.append(this.pending); // a text node: model output never becomes markup
      this.text += this.pending;
      this.pending = "";
      if (follow) log.scrollTop = log.scrollHeight;
    }
    this.showRate();
  }

  showRate() {
    if (this.firstAt === null) return;
    $("ttft").textContent = `${Math.round(this.firstAt - this.sentAt)} ms`;
    const seconds = (performance.now() - this.firstAt) / 1000;
    if (this.tokens > 1 && seconds > 0) $("rate").textContent = ((this.tokens - 1) / seconds).toFixed(1);
  }

  showUsage(usage) {
    const line = `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion = ${usage.total_tokens} tokens`;
    $("usage").textContent = line;
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = `${line} · ${$("ttft").textContent} to first token · ${$("rate").textContent} tokens/s`;
    this.turn.append(meta);
    this.turn.dataset.usage = JSON.stringify(usage);
  }

  fail(message) {
    this.turn.classList.add("error");
    this.body.append(`\n[error: ${message}]`);
  }

  finish(problem) {
    if (this.done) return;
    this.done = true;
    this.source.close();
    if (this.frame) cancelAnimationFrame(this.frame);
    this.flush();
    if (problem) this.fail(problem);
    this.turn.dataset.finishReason = this.finishReason || "";
    history.push({ role: "assistant", content: this.text });
    setStatus(this.finishReason === "cancelled" ? "stopped" : "done");
    setBusy(false);
    current = null;
  }
}

function cancelUrl(id) {
  return `/api/chat/completions/${id}/cancel`;
}

// Queue the reply on the server; resolves to {id, events_url} or throws with a message to show.
async function admitReply(payload) {
  let response;
  try {
    response = await postJSON("/api/chat/completions", payload);
  } catch {
    throw new Error("The server could not be reached.");
  }
  if (response.redirected) throw new Error("Your session has expired: reload the page and sign in.");
  const answer = await response.json().catch(() => null);
  if (!response.ok || !answer) throw new Error(answer?.error?.message || `${response.status} ${response.statusText}`);
  return answer;
}

async function send() {
  const content = prompt.value.trim();
  if (!content || current) return;
  prompt.value = "";
  history.push({ role: "user", content });
  addTurn("user", content);
  const turn = addTurn("assistant", "");
  setBusy(true);
  setStatus("generating");
  $("ttft").textContent = $("rate").textContent = $("usage").textContent = "–";
  current = { id: null, stopRequested: false, stream: new ReplyStream(turn, performance.now()) };
  let answer;
  try {
    answer = await admitReply({
      model: $("model").value,
      messages: history,
      temperature: Number($("temperature").value),
      max_tokens: Number($("max-tokens").value),
      stream: true,
    });
  } catch (error) {
    history.pop();
    turn.classList.add("error");
    turn.querySelector(".body").textContent = error.message;
    setStatus("error");
    current = null;
    return setBusy(false);
  }
  current.id = answer.id;
  current.stream.open(answer.events_url);
  if (current.stopRequested) stop();
}

function stop() {
  if (!current) return;
  if (!current.id) {
    current.stopRequested = true; // still being queued: stop as soon as it has an id
    return;
  }
  postJSON(cancelUrl(current.id), {});
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    send();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") stop();
});
$("stop").addEventListener("click", stop);
