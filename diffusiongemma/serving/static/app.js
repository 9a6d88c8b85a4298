// The DiffusionGemma page: chat over /v1/chat/completions (streamed, with the canvas extension events) and
// the canvas drawn after every denoiser pass; for a model without a chat format (a training run's), plain
// completion over /v1/completions (the text is the prompt). Plain JS, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, chat: true, messages: [], busy: false };
// Read by the browser test: how many canvas events were drawn and how many distinct canvases they showed.
window.dgStats = { canvasUpdates: 0, distinctCanvases: 0, replies: 0, lastCanvas: "" };

function visible(piece) {
  return piece.replace(/\n/g, "\u23ce").replace(/\t/g, "\u21e5").replace(/ /g, "\u00b7") || "\u2205";
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const thought = document.createElement("div");
  thought.className = "thought";
  thought.hidden = true;
  const content = document.createElement("span");
  content.className = "content";
  content.textContent = text || "";
  const draft = document.createElement("span");
  draft.className = "draft";
  const stats = document.createElement("div");
  stats.className = "stats";
  div.append(thought, content, draft, stats);
  $("transcript").append(div);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return { div, thought, content, draft, stats };
}

function drawCanvas(c) {
  const grid = $("canvas");
  if (grid.children.length !== c.tokens.length || grid.dataset.canvas !== String(c.canvas)) {
    grid.replaceChildren(...c.tokens.map(() => {
      const cell = document.createElement("div");
      cell.className = "cell";
      return cell;
    }));
    grid.dataset.canvas = String(c.canvas);
  }
  c.tokens.forEach((token, i) => {
    const cell = grid.children[i];
    const changed = cell.dataset.token !== undefined && cell.dataset.token !== String(token);
    cell.dataset.token = String(token);
    cell.textContent = visible(c.pieces[i]);
    cell.title = `position ${i}: token ${token} ${JSON.stringify(c.pieces[i])}`;
    cell.classList.toggle("changed", changed);
    cell.classList.toggle("accepted", c.accepted[i]);
    cell.classList.toggle("fixed", c.fixed[i]);
    cell.classList.toggle("committed", c.complete);
  });
  $("pass-counter").textContent =
    `canvas ${c.canvas + 1} \u00b7 pass ${c.pass}${c.complete ? " \u00b7 committed" : ""} \u00b7 ` +
    `${c.accepted.filter(Boolean).length} accepted this pass`;
  const key = c.tokens.join(",");
  window.dgStats.canvasUpdates += 1;
  if (key !== window.dgStats.lastCanvas) window.dgStats.distinctCanvases += 1;
  window.dgStats.lastCanvas = key;
}

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

function requestBody(text) {
  const body = { model: state.model, stream: true, stream_canvas: true };
  if (state.chat) body.messages = state.messages;
  else body.prompt = text;
  const number = (id) => ($(id).value === "" ? null : Number($(id).value));
  if (number("max-tokens") !== null) body.max_tokens = number("max-tokens");
  if (number("temperature") !== null) body.temperature = number("temperature");
  if (number("seed") !== null) body.seed = number("seed");
  if ($("thinking").checked && state.chat) body.reasoning_effort = "medium";
  const schema = $("schema").value.trim();
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "page_schema", schema: JSON.parse(schema) } };
  }
  return body;
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  let content = "", thought = "";
  let body;
  try {
    body = requestBody(text);
  } catch (e) {
    reply.div.classList.add("error");
    reply.content.textContent = `The JSON schema is not valid JSON: ${e.message}`;
    state.messages.pop();
    return;
  }
  const response = await fetch(state.chat ? "/v1/chat/completions" : "/v1/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  if (!response.ok) {
    const error = await response.json().catch(() => ({ error: { message: response.statusText } }));
    reply.div.classList.add("error");
    reply.content.textContent = `${response.status}: ${error.error.message}`;
    state.messages.pop();
    return;
  }
  for await (const { event, data } of sseEvents(response)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) {
      reply.div.classList.add("error");
      reply.content.textContent = chunk.error.message;
      continue;
    }
    if (event === "canvas") {
      drawCanvas(chunk.canvas);
      reply.draft.textContent = chunk.canvas.draft.content.slice(content.length);
      continue;
    }
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) continue;
    const delta = choice.delta || { content: choice.text };  // a completion chunk carries `text`
    if (delta.reasoning_content) {
      thought += delta.reasoning_content;
      reply.thought.hidden = false;
      reply.thought.textContent = thought;
    }
    if (delta.content) {
      content += delta.content;
      reply.content.textContent = content;
    }
    if (choice.finish_reason) {
      const d = chunk.diffusion || {};
      reply.stats.textContent = `${choice.finish_reason} \u00b7 ${d.denoiser_passes} passes \u00b7 ` +
        `${d.canvases} canvas(es) \u00b7 ${d.tokens_per_pass} tokens/pass \u00b7 batch of ${d.batch_size} \u00b7 seed ${d.seed}`;
    }
  }
  reply.draft.textContent = "";
  reply.content.textContent = content;
  reply.div.dataset.done = "true";
  state.messages.push({ role: "assistant", content });
  window.dgStats.replies += 1;
}

$("form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("message").value.trim();
  if (!text || state.busy) return;
  state.busy = true;
  $("send").disabled = true;
  $("message").value = "";
  try {
    await send(text);
  } catch (err) {
    addMessage("error", String(err)).div.classList.add("error");
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
});
$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("reset").addEventListener("click", () => { state.messages = []; $("transcript").replaceChildren(); });

fetch("/v1/models").then((r) => r.json()).then((models) => {
  state.model = models.data[0].id;
  state.chat = models.data[0].chat !== false;
  $("model").textContent = state.model + (state.chat ? "" : " (no chat format: plain completion)");
});
fetch("/health").then((r) => r.json()).then((h) => { $("status").textContent = h.status; });
