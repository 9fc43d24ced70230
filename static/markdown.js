// Streaming markdown: completed blocks are rendered once and frozen; only the growing tail is
// rendered again, with its half-open markers closed and its half-arrived table rows and
// reference labels held back, so they never show raw. When the reply ends it is rendered whole
// by renderBlock, the same function that shows a saved reply: what streamed and what a reload
// shows are one DOM. Everything goes through DOMPurify, and HTML written by the model is shown
// as text.
"use strict";

const SAFE_URL = /^(?:https?:|mailto:|#)/i;
const FENCE = /^ {0,3}(`{3,}|~{3,})/;

function escapeHTML(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

marked.use({
  gfm: true,
  renderer: {
    html: ({ text }) => escapeHTML(text), // the model's HTML is text to read, never markup
  },
});

// Links open apart from the page and tell nothing of it; remote images are not fetched: they
// become links the reader may follow.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    if (node.hasAttribute("href") && !SAFE_URL.test(node.getAttribute("href"))) node.removeAttribute("href");
    node.setAttribute("rel", "noopener noreferrer nofollow");
    node.setAttribute("target", "_blank");
  }
});

function imageAsLink(fragment) {
  for (const image of fragment.querySelectorAll("img")) {
    const link = document.createElement("a");
    const source = image.getAttribute("src") || "";
    if (SAFE_URL.test(source)) link.href = source;
    link.rel = "noopener noreferrer nofollow";
    link.target = "_blank";
    link.className = "image-link";
    link.textContent = `[image: ${image.getAttribute("alt") || source}]`;
    image.replaceWith(link);
  }
  return fragment;
}

function renderMarkdown(text) {
  const html = marked.parse(text);
  const clean = DOMPurify.sanitize(html, {
    RETURN_DOM_FRAGMENT: true,
    FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "iframe"],
    FORBID_ATTR: ["style"],
    ALLOWED_URI_REGEXP: /^(?:https?:|mailto:|#|[^a-z]|[a-z+.-]+(?:[^a-z+.\-:]|$))/i,
  });
  return withoutEmptyCode(unlinkPending(imageAsLink(clean)));
}

// A fence with nothing in it yet (a reply cut right after its opening "```") is no code to show
// or copy.
function withoutEmptyCode(fragment) {
  for (const pre of fragment.querySelectorAll("pre")) if (!pre.textContent.trim()) pre.remove();
  return fragment;
}

const LIST_ITEM = /^(?:[*+-]|\d{1,9}[.)])\s/;

// Where the text's completed blocks end (0 when none is). A closing code fence ends its block
// at once. A blank line outside a fence ends the block before it once the next line has begun
// and cannot continue that block: an indented line goes on a list item or indented code, and a
// list item after a list goes on the same (loose) list.
function completedLength(text) {
  const lines = text.split("\n");
  let fence = null;
  let done = 0;
  let offset = 0;
  let blankAt = -1;
  lines.forEach((line, index) => {
    const start = offset;
    offset += line.length + 1;
    const last = index === lines.length - 1; // may still grow: only its start is known
    if (fence) {
      if (!last && closesFence(line, fence)) [fence, done] = [null, offset];
    } else if (!line.trim()) {
      if (!last && blankAt < 0) blankAt = start;
    } else {
      if (blankAt >= 0 && decided(line, last) && !continues(text.slice(done, blankAt), line)) done = start;
      blankAt = -1;
      if (!last && line.match(FENCE)) fence = line.match(FENCE)[1];
    }
  });
  return done;
}

// Enough of a line has arrived to tell whether it continues the block above.
function decided(line, last) {
  return !last || /^\s/.test(line) || !/^[*+\-\d]/.test(line) || /^\S+\s/.test(line);
}

function continues(block, line) {
  if (/^\s/.test(line)) return true;
  return LIST_ITEM.test(block.trimStart()) && LIST_ITEM.test(line);
}

function closesFence(line, fence) {
  const marker = line.match(FENCE);
  return marker && marker[1][0] === fence[0] && marker[1].length >= fence.length && !line.trim().slice(marker[1].length);
}

// A tail's open fence ("```", "~~~~"...) if any, and where its last closed fence ended.
function fences(text) {
  let fence = null;
  let closedAt = 0;
  let offset = 0;
  for (const line of text.split("\n")) {
    offset += line.length + 1;
    if (fence && closesFence(line, fence)) {
      fence = null;
      closedAt = Math.min(offset, text.length);
    } else if (!fence && line.match(FENCE)) {
      fence = line.match(FENCE)[1];
    }
  }
  return { fence, closedAt };
}

// Close what a growing paragraph left open, so that "**bo" shows as bold and a marker that is
// still arriving ("*" of "**") waits for the next frame instead of flashing raw.
function closeInline(text) {
  let body = text.replace(/[*_~`]+$/, "");
  const trailing = body.match(/\s*$/)[0];
  body = body.slice(0, body.length - trailing.length);
  body = body.replace(/\[([^\]\n]*)\]\([^)\s]*$/, "$1"); // a link whose address is arriving
  body = body.replace(/(?<!\])\[([^\]\n]*)\](?:\[[^\]\n]*)?$/, "$1"); // "[text]" or "[text][lab": a link or reference arriving
  let closers = "";
  const code = (body.match(/`/g) || []).length;
  if (code % 2) closers += "`";
  const prose = body.replace(/`[^`]*`?/g, "").replace(/^\s*[*+-]\s+/gm, "");
  for (const marker of ["**", "__", "~~"]) {
    if (prose.split(marker).length % 2 === 0) closers += marker;
  }
  const singles = prose.replace(/\*\*|__/g, "");
  if ((singles.match(/\*/g) || []).length % 2) closers += "*";
  return body + closers + trailing;
}

function closeOpen(tail) {
  const { fence, closedAt } = fences(tail);
  if (!fence) return tail.slice(0, closedAt) + closeInline(tail.slice(closedAt));
  const code = tail.replace(/\n {0,3}[`~]+$/, ""); // a closing fence still arriving is not code
  return `${code}\n${fence}`;
}

// A block as it stays (frozen, or a whole reply once ended): rendered, its code highlighted,
// and each code block given a Copy button. The tail is never highlighted: it changes every frame.
function renderBlock(text) {
  return withCopyButtons(highlightCode(renderMarkdown(text)));
}

// highlight.js writes HTML; it goes through DOMPurify like everything else (spans and classes).
function highlightCode(fragment) {
  for (const code of fragment.querySelectorAll("pre > code[class*='language-']")) {
    const language = code.className.match(/language-(\S+)/)[1];
    if (!hljs.getLanguage(language)) continue;
    const html = hljs.highlight(code.textContent, { language, ignoreIllegals: true }).value;
    code.replaceChildren(DOMPurify.sanitize(html, { RETURN_DOM_FRAGMENT: true, ALLOWED_TAGS: ["span"], ALLOWED_ATTR: ["class"] }));
  }
  return fragment;
}

// Added after sanitizing (the model's own markup may hold no button); chat.js handles the clicks.
function withCopyButtons(fragment) {
  for (const pre of fragment.querySelectorAll("pre")) {
    const block = document.createElement("div");
    block.className = "code-block";
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy-code";
    button.textContent = "Copy";
    button.setAttribute("aria-label", "Copy the code");
    pre.replaceWith(block);
    block.append(pre, button);
  }
  return fragment;
}

// -- reference definitions: "[label]: url" may come after the "[text][label]" that uses it -----

const DEFINITION = /^ {0,3}\[[^\]\n]+\]:[ \t]*\S/;
const DEFINITION_START = /^ {0,3}\[[^\]\n]*(?:\]:?)?[ \t]*$/; // "[lab", "[label]:": a definition, or not yet known

// The text's reference definitions outside code fences, one a line.
function definitions(text) {
  let fence = null;
  const found = [];
  for (const line of text.split("\n")) {
    if (fence) {
      if (closesFence(line, fence)) fence = null;
    } else if (line.match(FENCE)) fence = line.match(FENCE)[1];
    else if (DEFINITION.test(line)) found.push(line.trim());
  }
  return found.join("\n");
}

const REFERENCE_USE = /\[([^\]\n]+)\]\[([^\]\n]*)\]/g; // "[text][label]", "[label][]"
const PENDING = "#tokstream-pending-reference";

function label(text) {
  return text.trim().replace(/\s+/g, " ").toLowerCase();
}

// A piece rendered apart from the rest still resolves the links whose definitions are elsewhere;
// a reference whose definition has not arrived yet links to PENDING, so that it shows as its text
// (never "[text][label]" raw) until the definition comes and the piece is rendered again.
function withDefinitions(markdown, known) {
  if (!markdown.includes("[")) return markdown;
  const defined = new Set(known.split("\n").filter(Boolean).map((line) => label(line.slice(line.indexOf("[") + 1, line.indexOf("]:")))));
  const pending = new Set();
  for (const [, text, name] of markdown.matchAll(REFERENCE_USE)) {
    const wanted = label(name || text);
    if (wanted && !defined.has(wanted)) pending.add(wanted);
  }
  const placeholders = [...pending].map((name) => `[${name}]: ${PENDING}`);
  return [markdown, known, ...placeholders].filter(Boolean).join("\n\n");
}

function unlinkPending(fragment) {
  for (const link of fragment.querySelectorAll(`a[href="${PENDING}"]`)) {
    const text = document.createElement("span");
    text.className = "pending-link";
    text.append(...link.childNodes);
    link.replaceWith(text);
  }
  return fragment;
}

// -- what the tail holds back until the next line tells what it is ------------------------------

function hasPipe(line) {
  return line.replace(/`[^`]*`/g, "").replace(/`.*$/, "").includes("|");
}

// A row still arriving, or a line with a pipe whose next line may make it a table's header (the
// delimiter row "| --- |" comes next), would flash raw as a paragraph of pipes; so would a
// reference definition's label before its address. They wait for the next line.
function withoutPending(tail) {
  if (fences(tail).fence) return tail;
  const lines = tail.split("\n");
  const [before, previous, last] = ["", "", ...lines].slice(-3);
  let held = hasPipe(last) || DEFINITION_START.test(last) ? 1 : 0;
  const mayBeDelimiter = held || /^[\s|:-]*$/.test(last);
  if (mayBeDelimiter && hasPipe(previous) && !hasPipe(before)) held = 2; // a header: shown once its delimiter row is whole
  return held ? lines.slice(0, lines.length - held).join("\n") : tail;
}

class StreamingMarkdown {
  constructor(container) {
    this.container = container;
    this.text = "";
    this.frozen = 0; // characters of this.text already rendered into frozen blocks
    this.defined = ""; // the reference definitions of the frozen text
    this.known = ""; // the definitions the frozen blocks were rendered with
    this.linking = []; // frozen blocks with brackets: rendered again when a definition arrives
    this.tail = document.createElement("div");
    this.tail.className = "md-tail";
    container.append(this.tail);
  }

  append(text) {
    this.text += text;
  }

  // Called at most once per frame: freeze what completed, re-render only the tail.
  render() {
    const done = this.frozen + completedLength(this.text.slice(this.frozen)); // a freeze is never inside a fence
    const piece = this.text.slice(this.frozen, done);
    this.frozen = done;
    this.defined = [this.defined, definitions(piece)].filter(Boolean).join("\n");
    const tail = this.text.slice(done);
    // The tail's whole lines only: a definition's address is known once its line has ended, and
    // the frozen blocks are rendered again once for it, not once a frame while it arrives.
    this.relink([this.defined, definitions(tail.slice(0, tail.lastIndexOf("\n") + 1))].filter(Boolean).join("\n"));
    if (piece.trim()) this.freeze(piece);
    this.renderTail(tail);
  }

  freeze(piece) {
    const block = document.createElement("div");
    block.className = "md-block";
    block.append(renderBlock(withDefinitions(piece, this.known)));
    this.tail.before(block);
    if (piece.includes("[")) this.linking.push({ block, piece });
  }

  // A definition arrived: the frozen blocks that may use it are rendered again with it (rare:
  // once per definition, and only blocks with brackets).
  relink(known) {
    if (known === this.known) return;
    this.known = known;
    this.tailText = null;
    for (const { block, piece } of this.linking) block.replaceChildren(renderBlock(withDefinitions(piece, known)));
  }

  renderTail(tail) {
    if (tail === this.tailText) return;
    this.tailText = tail;
    this.tail.replaceChildren(renderMarkdown(withDefinitions(closeOpen(withoutPending(tail)), this.known)));
  }

  // The reply ended: it is rendered whole, as a saved reply is (once per reply).
  finish() {
    this.tailText = null;
    this.container.replaceChildren(renderBlock(this.text));
  }
}

window.StreamingMarkdown = StreamingMarkdown;
window.renderMarkdown = renderMarkdown;
window.renderBlock = renderBlock;
window.closeOpen = closeOpen;
window.withoutPending = withoutPending;
