// The chat page. A reply follows its request's events with EventSource: messages only append
// to a queue, and one animation frame paints whatever arrived since the last.
"use strict";

const $ = (id) => document.getElementById(id);
const log = $("log");
const prompt = $("prompt");
// Text reads smoothly at ~30 paints a second; painting every frame would only add layouts.
const PAINT_EVERY_MS = 28;
// A prompt read for longer than this says so; a quick one goes straight to "generating", so the
// status region does not announce a state nobody had time to see.
const SLOW_PROMPT_MS = 1000;
const state = { chat: JSON.parse($("chat-data").textContent), reply: null, following: true };

// -- talking to the server ---------------------------------------------------------------

function csrfToken() {
  return document.querySelector("[name=csrfmiddlewaretoken]").value;
}

// POST JSON; resolves to the answer's JSON, or throws an Error with the message to show.
async function post(url, payload) {
  let response;
  try {
    response = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
      body: JSON.stringify(payload),
      credentials: "same-origin",
    });
  } catch {
    throw new Error("The server could not be reached.");
  }
  if (response.redirected) throw new Error("Your session has expired: reload the page and sign in.");
  const answer = await response.json().catch(() => null);
  if (!response.ok || !answer) throw new Error(answer?.error?.message || `${response.status} ${response.statusText}`);
  return answer;
}

async function fetchChat(id) {
  const response = await fetch(`/api/chats/${id}`, { credentials: "same-origin" });
  if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
  return response.json();
}

function parameters() {
  const params = { model: $("model").value, temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) };
  if ($("seed").value !== "") params.seed = Number($("seed").value);
  const tools = $("tools").value.trim();
  if (tools) params.tools = JSON.parse(tools); // checked by checkTools before sending
  return params;
}

function checkTools() {
  const tools = $("tools").value.trim();
  if (!tools) return null;
  try {
    if (!Array.isArray(JSON.parse(tools))) return "Tools must be a JSON array of tool definitions.";
  } catch (error) {
    return `Tools are not valid JSON: ${error.message}`;
  }
  return null;
}

// -- the view ------------------------------------------------------------------------------

function atBottom() {
  return log.scrollHeight - log.scrollTop - log.clientHeight < 24;
}

// New text is followed only while the reader is at the bottom (as of their last scroll);
// otherwise a button offers to jump there. Called after a frame's writes: its one layout read.
function keepInView() {
  if (state.following) log.scrollTop = log.scrollHeight;
  else $("jump").hidden = false;
}

function jumpToLatest() {
  state.following = true;
  keepInView();
}

function onScroll() {
  state.following = atBottom();
  if (state.following) $("jump").hidden = true;
}

// Only changes reach the polite status region, so it announces each state once.
function setStatus(text) {
  if ($("status").textContent !== text) $("status").textContent = text;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("steer-form").hidden = !busy;
  log.setAttribute("aria-busy", String(busy));
  for (const button of log.querySelectorAll(".reply-action")) button.disabled = busy;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function addUserTurn(turn) {
  const node = element("article", "turn user");
  node.dataset.turnId = turn.id || "";
  node.append(element("div", "body", turn.content));
  log.append(node);
  return node;
}

function addReplyTurn(turn) {
  const node = element("article", "turn assistant");
  node.dataset.turnId = turn.id || "";
  node.dataset.model = turn.model || "";
  node.append(element("div", "body"), element("div", "tool-calls"), element("footer", "meta"));
  log.append(node);
  return node;
}

// The cost and what it is made of: the prompt read afresh, the prompt served from a cache (at
// its own, lower price) and the reply.
function formatCost(usage) {
  if (usage.cost === null || usage.cost === undefined) return "cost unknown";
  const total = `${usage.cost} ${usage.currency || ""}`.trim();
  if (usage.input_cost === undefined || usage.input_cost === null) return total;
  return `${total} (input ${usage.input_cost} + cached input ${usage.cached_input_cost} + output ${usage.output_cost})`;
}

function usageLine(usage) {
  const cached = usage.cached_prompt_tokens ? ` (${usage.cached_prompt_tokens} cached)` : "";
  return `${usage.prompt_tokens} prompt${cached} + ${usage.completion_tokens} completion = ${usage.total_tokens} tokens · ${formatCost(usage)}`;
}

// The bar shows one reply's numbers and says which: the one streaming (live), else the last one
// that ended (its ledger entry's, as under the reply).
function showBarNumbers(usage) {
  $("stats-of").textContent = "Last reply:";
  $("ttft").textContent = usage.time_to_first_token_ms === null ? "–" : `${usage.time_to_first_token_ms} ms`;
  $("rate").textContent = usage.tokens_per_second === null ? "–" : String(usage.tokens_per_second);
  $("completion").textContent = String(usage.completion_tokens);
  $("usage").textContent = usageLine(usage);
}

function timingLine(usage) {
  const parts = [];
  if (usage.time_to_first_token_ms !== null) parts.push(`${usage.time_to_first_token_ms} ms to first token`);
  if (usage.tokens_per_second !== null) parts.push(`${usage.tokens_per_second} tokens/s`);
  return parts.join(" · ");
}

// How a reply ended, from its ledger entry: the same words live and after a reload.
const ENDINGS = { completed: "Completed", tool_calls: "Called a tool", length: "Cut at the token limit", cancelled: "Cancelled", failed: "Failed" };

function endingLine(usage) {
  if (usage.status === "failed") return `Failed: ${usage.why || "the reply could not be written"}`;
  if (usage.status === "cancelled" && usage.why) return usage.why;
  return ENDINGS[usage.status] || usage.status;
}

function showNumbers(node, usage) {
  const meta = node.querySelector(".meta");
  const ending = element("span", `ending ${usage.status}`, endingLine(usage));
  const model = element("span", "model", node.dataset.model); // which model wrote it
  meta.replaceChildren(ending, model, element("span", "usage", usageLine(usage)), element("span", "timing", timingLine(usage)));
  node.dataset.usage = JSON.stringify(usage);
  node.dataset.ending = usage.status;
}

// -- tool calls: arguments grow as text; parsed once the call is complete ------------------

class ToolCalls {
  constructor(container) {
    this.container = container;
    this.calls = [];
  }

  start(call) {
    const node = element("details", "tool-call");
    node.open = true;
    const name = element("summary", "tool-name", `${call.function.name}()`);
    const args = element("pre", "tool-args", call.function.arguments || "");
    node.append(name, args);
    this.container.append(node);
    this.calls[call.index] = { node, args, text: call.function.arguments || "", id: call.id };
  }

  grow(index, fragment) {
    const call = this.calls[index];
    if (!call) return;
    call.text += fragment;
    call.args.textContent = call.text;
  }

  // Called when the reply ends: only then is each call's JSON complete.
  complete() {
    for (const call of this.calls.filter(Boolean)) {
      const parsed = element("pre", "tool-parsed");
      try {
        parsed.textContent = JSON.stringify(JSON.parse(call.text), null, 2);
        call.node.classList.add("complete");
      } catch (error) {
        parsed.textContent = `The arguments are not valid JSON: ${error.message}`;
        call.node.classList.add("invalid");
      }
      call.args.replaceWith(parsed);
    }
  }
}

function showSavedCalls(node, calls) {
  const tools = new ToolCalls(node.querySelector(".tool-calls"));
  calls.forEach((call, index) => tools.start({ ...call, index }));
  tools.complete();
}

function ordinal(n) {
  const tens = n % 100;
  const suffix = tens >= 11 && tens <= 13 ? "th" : { 1: "st", 2: "nd", 3: "rd" }[n % 10] || "th";
  return `${n}${suffix}`;
}

// -- one streaming reply ---------------------------------------------------------------------

class Reply {
  constructor(node, turn, sentAt) {
    this.node = node;
    this.turn = turn;
    this.sentAt = sentAt;
    this.firstAt = null;
    this.completion = 0;
    this.received = ""; // all the text, as it arrived
    this.queue = []; // what arrived since the last frame, in order: text, steering marks
    this.frame = 0;
    this.paintedAt = -Infinity;
    this.finishReason = null;
    this.segment = this.newSegment();
    this.tools = new ToolCalls(node.querySelector(".tool-calls"));
  }

  newSegment() {
    const container = element("div", "md");
    this.node.querySelector(".body").append(container);
    return new StreamingMarkdown(container);
  }

  open(url) {
    this.source = new EventSource(url);
    this.source.onmessage = (event) => this.onMessage(event.data);
    this.source.onerror = () => this.onError();
    this.source.onopen = () => setStatus("generating"); // again, after a reconnect
  }

  onError() {
    if (this.done) return;
    if (this.source.readyState === EventSource.CLOSED) return this.finish("the connection was closed");
    setStatus("reconnecting…"); // EventSource reconnects by itself, from the last event id
  }

  onMessage(data) {
    if (data === "[DONE]") return this.finish();
    const chunk = JSON.parse(data);
    if (chunk.error) return this.enqueue({ error: chunk.error.message });
    if (chunk.usage) this.completion = chunk.usage.completion_tokens;
    if (chunk.tokstream?.steered !== undefined) this.enqueue({ steered: chunk.tokstream.steered, refused: chunk.tokstream.error });
    if (chunk.tokstream && this.firstAt === null) this.showPlace(chunk.tokstream);
    const choice = chunk.choices[0];
    if (!choice) return;
    if (choice.delta.content) this.enqueue({ text: choice.delta.content });
    for (const call of choice.delta.tool_calls || []) this.enqueue({ call });
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
  }

  // Until the first token: how many are in line before this reply (shown once anyone is), then
  // that its prompt is being read (once it was in line, or when reading it takes a while).
  showPlace(place) {
    if (place.queue_position > 0 || (place.queue_position === 0 && this.waited)) {
      this.waited = true;
      setStatus(place.queue_position > 0 ? `${ordinal(place.queue_position + 1)} in line` : "next in line");
    } else if (place.reading_prompt && (this.waited || this.sentAt === null || performance.now() - this.sentAt > SLOW_PROMPT_MS)) {
      setStatus("reading your prompt");
    }
  }

  enqueue(item) {
    if (this.firstAt === null && (item.text || item.call)) {
      this.firstAt = performance.now();
      setStatus("generating");
    }
    this.queue.push(item);
    if (!this.frame) this.frame = requestAnimationFrame((now) => this.onFrame(now));
  }

  onFrame(now) {
    if (now - this.paintedAt < PAINT_EVERY_MS) {
      this.frame = requestAnimationFrame((later) => this.onFrame(later));
      return;
    }
    this.paintedAt = now;
    this.paint();
  }

  // Writes first, then the one read that scrolling needs: one layout per painted frame.
  paint() {
    this.frame = 0;
    for (const item of this.queue.splice(0)) this.apply(item);
    this.segment.render();
    this.showRate();
    keepInView();
  }

  apply(item) {
    if (item.text) {
      this.segment.append(item.text);
      this.received += item.text;
    } else if (item.call?.id) this.tools.start(item.call);
    else if (item.call) this.tools.grow(item.call.index, item.call.function?.arguments || "");
    else if (item.steered !== undefined) this.markSteering(item.steered, item.refused);
    else if (item.error) this.node.querySelector(".body").append(element("p", "error-text", `Error: ${item.error}`));
  }

  // The reply shows where the user's instruction took effect; text after it is a new block.
  markSteering(text, refused) {
    this.segment.render();
    this.segment.finish();
    const mark = element("div", refused ? "steer-mark refused" : "steer-mark", refused ? `Instruction not applied: ${refused}` : `↳ ${text.trim()}`);
    this.node.querySelector(".body").append(mark);
    this.segment = this.newSegment();
  }

  // Live numbers, until the ledger's replace them. A reply followed again after a reload
  // replays what it had written in one burst: a rate measured from that would be the replay's,
  // so such a reply shows none until the ledger's.
  showRate() {
    $("completion").textContent = String(this.completion);
    if (this.firstAt === null || this.sentAt === null) return;
    $("ttft").textContent = `${Math.round(this.firstAt - this.sentAt)} ms`;
    // As the ledger counts it (completion tokens over the time since the first), so the live
    // figure at the end is the one the ledger then shows.
    const seconds = (performance.now() - this.firstAt) / 1000;
    if (this.completion > 1 && seconds > 0) $("rate").textContent = (this.completion / seconds).toFixed(1);
  }

  async finish(problem) {
    if (this.done) return;
    this.done = true;
    this.source.close();
    if (this.frame) cancelAnimationFrame(this.frame);
    this.paint();
    this.segment.finish();
    this.tools.complete();
    if (problem) this.node.querySelector(".body").append(element("p", "error-text", `Error: ${problem}`));
    markEnded(this.node, this.received);
    this.node.dataset.finishReason = this.finishReason || "";
    state.reply = null;
    setBusy(false);
    setStatus(this.finishReason === "cancelled" ? "stopped" : "done");
    keepInView();
    await this.showLedgerNumbers();
    keepInView();
  }

  // The numbers under a reply come from its ledger entry, written before the stream ended.
  async showLedgerNumbers() {
    try {
      const chat = await fetchChat(state.chat.id);
      const saved = chat.turns.find((turn) => turn.id === this.turn.id);
      if (saved?.usage) {
        showNumbers(this.node, saved.usage);
        showBarNumbers(saved.usage);
      }
      addReplyActions();
    } catch (error) {
      this.node.querySelector(".meta").textContent = `Usage could not be read: ${error.message}`;
    }
  }
}

// -- actions ---------------------------------------------------------------------------------

function startReply(answer, sentAt) {
  const turn = answer.turns[answer.turns.length - 1];
  follow(new Reply(addReplyTurn(turn), turn, sentAt), answer.request_id, answer.events_url);
  jumpToLatest();
  if (state.stopRequested) stop();
}

// The page's one streaming reply, from its events URL (from the start when no id was seen).
function follow(reply, requestId, eventsUrl) {
  state.reply = reply;
  reply.requestId = requestId;
  reply.open(eventsUrl);
  $("stats-of").textContent = "This reply, live:";
  setBusy(true);
  setStatus("generating");
}

function resetNumbers() {
  for (const id of ["ttft", "rate", "completion", "usage"]) $(id).textContent = "–";
}

// A chat keeps the model and parameters it was last sent with: opened again, it has them.
function showSettings(settings) {
  if (!settings) return;
  if (settings.model && [...$("model").options].some((option) => option.value === settings.model)) $("model").value = settings.model;
  const fields = { temperature: "temperature", max_tokens: "max-tokens", seed: "seed" };
  for (const [name, id] of Object.entries(fields)) if (settings[name] !== undefined) $(id).value = settings[name];
  if (settings.tools) $("tools").value = JSON.stringify(settings.tools);
}

async function renameChat() {
  const title = window.prompt("Rename this chat", document.querySelector(".chat-link.current")?.textContent || "");
  if (!title || !title.trim()) return;
  try {
    const chat = await post(`/api/chats/${state.chat.id}/rename`, { title });
    for (const link of document.querySelectorAll(`#chat-list a[href="${chat.url}"]`)) link.textContent = chat.title;
    document.title = `${chat.title} · tokstream`;
  } catch (error) {
    showError(`Not renamed: ${error.message}`, renameChat);
  }
}

async function deleteChat() {
  if (!window.confirm("Delete this chat? Its usage stays in the ledger.")) return;
  try {
    await post(`/api/chats/${state.chat.id}/delete`, {});
    window.location.assign("/");
  } catch (error) {
    showError(`Not deleted: ${error.message}`, deleteChat);
  }
}

function rememberChat(chat) {
  if (state.chat.id === chat.id) return;
  state.chat = chat;
  $("chat-actions").hidden = false;
  history.replaceState(null, "", chat.url);
  const link = element("a", "chat-link current", chat.title);
  link.href = chat.url;
  $("chat-list").prepend(element("li", "", ""));
  $("chat-list").firstChild.append(link);
  $("system-prompt").disabled = true;
}

// Sends the composer's message: a new one, or the last one edited (which replaces it and its reply).
async function send() {
  const content = prompt.value.trim();
  if (!content || state.reply || state.sending) return;
  const problem = checkTools();
  if (problem) return showError(problem, send);
  state.sending = true;
  state.stopRequested = false;
  hideError();
  removeReplyActions();
  resetNumbers();
  const sentAt = performance.now();
  const edited = state.editing;
  const userNode = addUserTurn({ content });
  jumpToLatest();
  setStatus("sending");
  try {
    const answer = await post(sendUrl(edited), { content, system_prompt: $("system-prompt").value, ...parameters() });
    prompt.value = "";
    countAsked++;
    $("prompt-count").textContent = "";
    if (edited) removeTurns(edited, userNode);
    stopEditing();
    userNode.dataset.turnId = answer.turns[0].id;
    rememberChat(answer.chat);
    startReply(answer, sentAt);
  } catch (error) {
    userNode.remove();
    failed(edited ? "Not edited" : "Not sent", error, send);
  } finally {
    state.sending = false;
  }
}

function sendUrl(edited) {
  if (edited) return `/api/chats/${state.chat.id}/edit`;
  return state.chat.id ? `/api/chats/${state.chat.id}/messages` : "/api/chats/messages";
}

// A send or regenerate the server refused: the reason in the alert, with a Retry of the same
// action, and the conversation's own actions back as they were.
function failed(what, error, retry) {
  setStatus("");
  addReplyActions();
  showError(`${what}: ${error.message}`, retry);
}

async function regenerate() {
  if (state.reply || state.sending) return;
  state.sending = true;
  const last = log.querySelector(".turn.assistant:last-of-type");
  hideError();
  removeReplyActions();
  resetNumbers();
  const sentAt = performance.now();
  try {
    const answer = await post(`/api/chats/${state.chat.id}/regenerate`, parameters());
    last?.remove();
    startReply(answer, sentAt);
  } catch (error) {
    failed("Not regenerated", error, regenerate);
  } finally {
    state.sending = false;
  }
}

// The conversation's actions, on its last turns: Edit on the last message; Regenerate on the
// last reply, and Continue where it was cut at the token limit.
function addReplyActions() {
  removeReplyActions();
  const last = log.lastElementChild;
  if (!last || !last.classList.contains("assistant")) return;
  last.append(actionButton("regenerate", "Regenerate", regenerate));
  if (last.dataset.ending === "length") last.append(actionButton("continue", "Continue", continueReply));
  const asked = last.previousElementSibling;
  if (asked?.classList.contains("user")) asked.append(actionButton("edit", "Edit", () => startEditing(asked)));
}

function actionButton(className, label, action) {
  const button = element("button", `${className} reply-action link`, label);
  button.type = "button";
  button.addEventListener("click", action);
  return button;
}

function continueReply() {
  stopEditing();
  prompt.value = "Continue.";
  send();
}

function removeReplyActions() {
  for (const button of log.querySelectorAll(".reply-action")) button.remove();
}

// -- edit and resend the last message ----------------------------------------------------------

function startEditing(turn) {
  state.editing = turn;
  prompt.value = turn.querySelector(".body").textContent;
  $("editing").hidden = false;
  prompt.focus();
  countSoon();
}

function stopEditing() {
  state.editing = null;
  $("editing").hidden = true;
}

function cancelEditing() {
  stopEditing();
  prompt.value = "";
  $("prompt-count").textContent = "";
}

// The edited message and its reply leave the page as they left the chat; `until` is their successor.
function removeTurns(first, until) {
  for (let node = first; node && node !== until; ) {
    const next = node.nextElementSibling;
    node.remove();
    node = next;
  }
}

// -- errors, where they are seen ---------------------------------------------------------------

function showError(message, retry) {
  state.retry = retry || null;
  $("alert-text").textContent = message;
  $("retry").hidden = !retry;
  $("alert").hidden = false;
}

function hideError() {
  state.retry = null;
  $("alert").hidden = true;
}

function retry() {
  const action = state.retry;
  hideError();
  action?.();
}

// -- copying a reply's markdown, or a code block's code ---------------------------------------

const COPIED_MS = 1500; // how long a button says "Copied"

// A reply that ended keeps its source text, for Copy.
function markEnded(node, text) {
  node.dataset.text = text;
  if (node.querySelector(".copy-reply")) return;
  const button = element("button", "copy-reply link", "Copy");
  button.type = "button";
  button.setAttribute("aria-label", "Copy the reply's markdown");
  node.querySelector(".meta").after(button);
}

function copiedText(button) {
  if (button.classList.contains("copy-reply")) return button.closest(".turn").dataset.text;
  return button.closest(".code-block").querySelector("code").textContent;
}

// The button says how it went: an alert would take the place of a failed send's Retry.
async function copy(button) {
  try {
    await navigator.clipboard.writeText(copiedText(button));
    button.textContent = "Copied";
  } catch (error) {
    button.textContent = "Not copied";
    button.title = error.message;
  }
  setTimeout(() => (button.textContent = "Copy"), COPIED_MS);
}

// Stop cancels on the server; the reply keeps what was written and ends with "cancelled".
function stop() {
  const reply = state.reply;
  if (!reply) {
    if (state.sending) state.stopRequested = true; // still being queued: stop once it has an id
    return;
  }
  setStatus("stopping");
  post(`/api/chat/completions/${reply.requestId}/cancel`, {}).catch((error) => setStatus(`Stop failed: ${error.message}`));
}

// The text joins the reply as it stands; a space keeps it from gluing onto the last word.
async function steer() {
  const reply = state.reply;
  let text = $("steer").value;
  if (!text.trim() || !reply) return;
  if (!/^\s/.test(text) && /\S$/.test(reply.received)) text = ` ${text}`;
  $("steer").value = "";
  try {
    await post(`/api/chat/completions/${reply.requestId}/steer`, { content: text });
    setStatus("instruction sent");
  } catch (error) {
    setStatus(`Instruction not sent: ${error.message}`);
  }
}

// -- what the message would cost, as it is typed --------------------------------------------

const COUNT_AFTER_MS = 300;
let countTimer = 0;
let countAsked = 0;

function countSoon() {
  clearTimeout(countTimer);
  countTimer = setTimeout(countPrompt, COUNT_AFTER_MS);
}

async function countPrompt() {
  const asked = ++countAsked;
  const content = prompt.value;
  if (!content.trim() || checkTools()) return ($("prompt-count").textContent = "");
  try {
    const counted = await post("/api/chats/count", { chat: state.chat.id, content, system_prompt: $("system-prompt").value, ...parameters() });
    if (asked !== countAsked) return; // a later keystroke asked again
    const cost = counted.estimated_cost ? ` · ${counted.estimated_cost.prompt} ${counted.estimated_cost.currency}` : "";
    $("prompt-count").textContent = `${counted.prompt_tokens} prompt tokens${cost}`;
  } catch {
    if (asked === countAsked) $("prompt-count").textContent = "";
  }
}

// -- the history the server kept ---------------------------------------------------------

function showSavedTurns(turns) {
  for (const turn of turns) {
    if (turn.role === "user") {
      addUserTurn(turn);
      continue;
    }
    const node = addReplyTurn(turn);
    if (turn.events_url) {
      // Still being written (or ended while the page was away): replay its whole stream. Its
      // time to first token is not this page's to measure; the ledger's comes at the end.
      follow(new Reply(node, turn, null), turn.request_id, turn.events_url);
      continue;
    }
    showSavedReply(node, turn);
  }
  if (!state.reply) addReplyActions();
  const last = turns.findLast((turn) => turn.role === "assistant");
  if (!state.reply && last?.usage) showBarNumbers(last.usage); // after a reload, as under the reply
  jumpToLatest();
}

function showSavedReply(node, turn) {
  const body = node.querySelector(".body");
  let offset = 0;
  for (const mark of turn.steering) {
    appendRendered(body, turn.content.slice(offset, mark.at));
    body.append(element("div", "steer-mark", `↳ ${mark.text.trim()}`));
    offset = mark.at;
  }
  appendRendered(body, turn.content.slice(offset));
  if (turn.tool_calls.length) showSavedCalls(node, turn.tool_calls);
  if (turn.error) body.append(element("p", "error-text", `Error: ${turn.error}`));
  markEnded(node, turn.content);
  node.dataset.finishReason = turn.finish_reason;
  if (turn.usage) showNumbers(node, turn.usage);
}

// As a streamed reply ends up (StreamingMarkdown.finish): one .md per part between steering marks.
function appendRendered(body, text) {
  const container = element("div", "md");
  container.append(renderBlock(text));
  body.append(container);
}

// -- the chat list as a drawer (narrow screens; chat.css shows the toggle there only) -----------

function openDrawer(open) {
  document.body.classList.toggle("drawer-open", open);
  $("drawer-toggle").setAttribute("aria-expanded", String(open));
  $("drawer-shade").hidden = !open;
  if (open) document.querySelector("#chats a")?.focus();
}

// -- wiring ------------------------------------------------------------------------------------

$("rename").addEventListener("click", renameChat);
$("delete").addEventListener("click", deleteChat);
$("drawer-toggle").addEventListener("click", () => openDrawer(!document.body.classList.contains("drawer-open")));
$("drawer-shade").addEventListener("click", () => openDrawer(false));
$("chats").addEventListener("click", (event) => {
  if (event.target.closest("a")) openDrawer(false);
});

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
prompt.addEventListener("input", countSoon);
$("model").addEventListener("change", countSoon);
prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
$("steer-form").addEventListener("submit", (event) => {
  event.preventDefault();
  steer();
});
document.addEventListener("keydown", (event) => {
  if (event.key !== "Escape") return;
  if (document.body.classList.contains("drawer-open")) openDrawer(false);
  else if (state.editing) cancelEditing();
  else stop();
});
$("stop").addEventListener("click", stop);
$("retry").addEventListener("click", retry);
$("dismiss").addEventListener("click", hideError);
$("cancel-edit").addEventListener("click", cancelEditing);
log.addEventListener("click", (event) => {
  const button = event.target.closest(".copy-code, .copy-reply");
  if (button) copy(button);
});
$("jump").addEventListener("click", jumpToLatest);
log.addEventListener("scroll", onScroll, { passive: true });

showSettings(state.chat.settings);
showSavedTurns(JSON.parse($("turns-data").textContent));
// Compile the renderer's code paths while idle, so a reply's first paint does not pay for it.
requestIdleCallback(() => renderBlock("*a* **b** `c` [d](https://e)\n\n- f\n\n```python\ng = 1\n```"));
