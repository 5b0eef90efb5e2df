"use strict";
(() => {
  const KEY_STORE = "sluice.apiKey";
  const $ = (id) => document.getElementById(id);
  const els = {
    messages: $("messages"), scroller: $("scroller"), input: $("input"), send: $("send"), stop: $("stop"),
    clear: $("clear"), model: $("model"), overlay: $("overlay"), keyForm: $("key-form"), keyInput: $("key-input"),
    keyWhy: $("key-why"), keyButton: $("key-button"), keyForget: $("key-forget"), composer: $("composer"),
    temperature: $("temperature"), tempError: $("temp-error"),
  };

  const state = {
    model: null,        // served model id
    context: 0,         // the server's context (max_model_len), tokens
    history: [],        // {role, content, tokens, measured, el, dropped}
    controller: null,   // AbortController of the running generation
    keyWaiters: [],     // resolvers waiting for a key to be entered
  };

  // -- element helpers: every piece of text goes in through textContent --------------------------

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function atBottom() {
    const s = els.scroller;
    return s.scrollHeight - s.scrollTop - s.clientHeight < 60;
  }

  function scrollDown(force) {
    if (force || atBottom()) els.scroller.scrollTop = els.scroller.scrollHeight;
  }

  function append(node) {
    const stick = atBottom();
    const empty = $("empty");
    if (empty) empty.remove();
    els.messages.appendChild(node);
    scrollDown(stick);
    return node;
  }

  // model text is rendered by markdown.js (DOM nodes and textContent only, linear time)
  const renderMarkdown = window.sluiceMarkdown.render;

  // -- the temperature: 0 is greedy (as `sluice chat`), else 0.001 to 2 (what the server accepts) -------

  const MIN_TEMPERATURE = 0.001, MAX_TEMPERATURE = 2;
  const TEMPERATURE_RULE = "temperature: 0 (greedy) or a number from " + MIN_TEMPERATURE + " to " + MAX_TEMPERATURE;

  function readTemperature() {
    // the field's value as a number, or null (with the reason shown) when the server would refuse it
    const raw = els.temperature.value.trim();
    const v = /^(\d+(\.\d*)?|\.\d+)$/.test(raw) ? Number(raw) : NaN;
    const ok = v === 0 || (v >= MIN_TEMPERATURE && v <= MAX_TEMPERATURE);
    els.temperature.setAttribute("aria-invalid", ok ? "false" : "true");
    els.tempError.hidden = ok;
    els.tempError.textContent = ok ? "" : "Not sent: " + JSON.stringify(raw) + " is not a valid " + TEMPERATURE_RULE + ".";
    return ok ? v : null;
  }

  // -- the API key -------------------------------------------------------------------------------

  let memoryKey = "";  // the key when the browser refuses local storage

  function storedKey() {
    try { return localStorage.getItem(KEY_STORE) || ""; } catch (e) { return ""; }
  }

  function askKey(why, refused) {
    els.keyWhy.textContent = why;
    els.keyWhy.className = refused ? "error" : "";
    els.keyInput.value = "";
    els.keyForget.hidden = !currentKey();
    els.overlay.hidden = false;
    els.keyInput.focus();
    return new Promise((resolve) => state.keyWaiters.push(resolve));
  }

  function keyEntered(key) {
    try {
      if (key) localStorage.setItem(KEY_STORE, key); else localStorage.removeItem(KEY_STORE);
    } catch (e) { /* storage disabled: the key lasts for this page only */ memoryKey = key; }
    els.overlay.hidden = true;
    els.keyButton.hidden = !key;
    const waiters = state.keyWaiters.splice(0);
    waiters.forEach((r) => r(key));
    els.input.focus();
  }

  function currentKey() { return storedKey() || memoryKey; }

  const NEEDS_KEY = "This server needs an API key (sluice serve --api-key). It is kept in this browser's local storage.";
  const WRONG_KEY = "The server refused this key. Enter the key the server was started with.";

  async function api(path, init) {
    // fetch with the stored key; on 401, ask for a key and try again.
    for (;;) {
      const headers = Object.assign({}, (init && init.headers) || {});
      const key = currentKey();
      if (key) headers["Authorization"] = "Bearer " + key;
      const r = await fetch(path, Object.assign({}, init, { headers }));
      if (r.status !== 401) return r;
      await askKey(key ? WRONG_KEY : NEEDS_KEY, !!key);
    }
  }

  async function errorText(r) {
    try {
      const body = await r.json();
      if (body && body.error && body.error.message) return { text: body.error.message, code: body.error.code };
    } catch (e) { /* not JSON */ }
    return { text: "the server answered " + r.status + " " + r.statusText, code: null };
  }

  // -- the model ---------------------------------------------------------------------------------

  async function loadModel() {
    try {
      const r = await api("v1/models");
      if (!r.ok) throw new Error((await errorText(r)).text);
      const card = (await r.json()).data[0];
      state.model = card.id;
      state.context = card.max_model_len || 0;
      els.model.textContent = card.id + (state.context ? " · context " + state.context + " tokens" : "");
      els.model.title = els.model.textContent;
    } catch (e) {
      els.model.textContent = "cannot reach the server: " + e.message;
    }
    els.keyButton.hidden = !currentKey();
  }

  // -- context trimming (client side, from the server's context and the usage it reports) --------

  function estimate(text) {
    // Until the server has counted a message, assume ~3 UTF-8 bytes per token plus the template's turn markers.
    return Math.ceil(new TextEncoder().encode(text).length / 3) + 8;
  }

  function live() { return state.history.filter((m) => !m.dropped); }

  function reserve() { return Math.min(256, Math.floor(state.context / 4)); }

  function dropOldestTurn() {
    // Drop the oldest user message and the replies after it, never the message being sent.
    const msgs = live();
    const lastUser = msgs.length - 1;
    if (lastUser < 1) return false;
    let n = 0;
    for (const m of msgs.slice(0, lastUser)) {
      if (m.role === "user" && n > 0) break;
      m.dropped = true;
      if (m.el) m.el.classList.add("dropped");
      n++;
    }
    return n > 0;
  }

  function trimToFit() {
    if (!state.context) return 0;
    const budget = state.context - reserve();
    let turns = 0;
    while (live().reduce((s, m) => s + m.tokens, 0) > budget && dropOldestTurn()) turns++;
    return turns;
  }

  function trimNotice(turns, before) {
    const n = el("div", "notice",
      "Context full: the " + (turns === 1 ? "oldest turn is" : turns + " oldest turns are") +
      " no longer sent to the model (context " + state.context + " tokens).");
    els.messages.insertBefore(n, before);
  }

  // -- streaming ---------------------------------------------------------------------------------

  async function* sseEvents(body) {
    // Server-sent events from a fetch body: yields the data of each event.
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  }

  function fmtBytes(n) {
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return (i ? n.toFixed(n < 10 ? 2 : 1) : String(n)) + " " + units[i];
  }

  function statsText(usage, finish, stopped) {
    const parts = [];
    if (usage) {
      const s = usage.sluice || {};
      parts.push(usage.completion_tokens + " tokens");
      if (s.decode_tok_s !== undefined) parts.push(s.decode_tok_s.toFixed(1) + " tok/s");
      if (s.hit_rate !== undefined) parts.push("hit rate " + (100 * s.hit_rate).toFixed(1) + "%");
      if (s.bytes_read !== undefined) parts.push("read " + fmtBytes(s.bytes_read));
      const cached = (usage.prompt_tokens_details || {}).cached_tokens;
      parts.push("prompt " + usage.prompt_tokens + " tokens" + (cached ? " (" + cached + " reused)" : ""));
      if (s.ttft_s !== undefined) parts.push("first token " + s.ttft_s.toFixed(2) + " s");
    }
    if (stopped) parts.push("stopped");
    else if (finish === "length") parts.push("cut by the token limit (context " + state.context + ")");
    return parts.join(" · ");
  }

  function setBusy(busy) {
    els.send.hidden = busy;
    els.stop.hidden = !busy;
  }

  function addMessage(role, content) {
    const box = el("div", "msg " + role);
    box.appendChild(el("div", "who", role === "user" ? "You" : (state.model || "assistant")));
    const body = box.appendChild(el("div", "body"));
    const m = { role, content, tokens: estimate(content), measured: false, el: box, body, dropped: false };
    if (role === "user") body.textContent = content;
    state.history.push(m);
    append(box);
    return m;
  }

  async function send(text, temperature) {
    if (!state.model) await loadModel();
    if (!state.model) {
      append(el("div", "error", "No model to talk to: " + els.model.textContent));
      return;
    }
    const user = addMessage("user", text);
    const reply = addMessage("assistant", "");
    state.history.pop();  // the reply joins the history once something arrives
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    let finish = null, usage = null, stopped = false, failed = null, pending = false, streaming = true;

    const paint = () => {
      pending = false;
      const stick = atBottom();
      renderMarkdown(reply.content, reply.body);
      if (streaming) {
        const last = reply.body.lastElementChild;
        (last ? (last.tagName === "PRE" ? last.firstChild : last) : reply.body).appendChild(el("span", "cursor"));
      }
      scrollDown(stick);
    };
    paint();

    try {
      let turns = trimToFit();
      let r;
      for (;;) {
        const messages = live().map((m) => ({ role: m.role, content: m.content }));
        r = await api("v1/chat/completions", {
          method: "POST", signal: controller.signal, headers: { "Content-Type": "application/json" },
          body: JSON.stringify({ model: state.model, messages, temperature, stream: true,
                                stream_options: { include_usage: true } }),
        });
        if (r.ok) break;
        const err = await errorText(r);
        if (err.code === "context_length_exceeded" && dropOldestTurn()) { turns++; continue; }
        throw new Error(err.text);
      }
      if (turns) trimNotice(turns, user.el);
      for await (const data of sseEvents(r.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) { failed = chunk.error.message; break; }
        if (chunk.usage) usage = chunk.usage;
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        if (choice.delta && choice.delta.content) {
          reply.content += choice.delta.content;
          if (!pending) { pending = true; requestAnimationFrame(paint); }
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    } catch (e) {
      if (e.name === "AbortError") stopped = true;
      else failed = e.message || String(e);
    } finally {
      state.controller = null;
      setBusy(false);
    }
    if (!reply.el.isConnected) return;  // the conversation was cleared meanwhile
    streaming = false;
    paint();
    if (reply.content) {
      state.history.push(reply);
      if (usage) {
        // What the server counted: the prompt (everything sent) and the reply.
        const others = live().filter((m) => m !== user && m !== reply).reduce((s, m) => s + m.tokens, 0);
        user.tokens = Math.max(1, usage.prompt_tokens - others);
        reply.tokens = usage.completion_tokens + 2;
      } else {
        reply.tokens = estimate(reply.content);
      }
    }
    const line = statsText(usage, finish, stopped);
    if (line) reply.el.appendChild(el("div", "stats", line));
    if (failed) reply.el.appendChild(el("div", "error", failed));
    if (!reply.content && !failed && !line) reply.el.remove();
    scrollDown(true);
  }

  // -- wiring ------------------------------------------------------------------------------------

  function submit() {
    const text = els.input.value;
    if (!text.trim() || state.controller) return;
    const temperature = readTemperature();
    if (temperature === null) { els.temperature.focus(); return; }  // the message stays in the box
    els.input.value = "";
    autosize();
    send(text, temperature);
  }

  function autosize() {
    els.input.style.height = "auto";
    els.input.style.height = Math.min(els.input.scrollHeight + 2, window.innerHeight * 0.4) + "px";
  }

  els.composer.addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  els.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
  });
  els.input.addEventListener("input", autosize);
  els.temperature.addEventListener("input", () => { if (!els.tempError.hidden) readTemperature(); });
  els.stop.addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  els.clear.addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    els.messages.replaceChildren(el("p", "empty", "Conversation cleared."));
    els.messages.firstChild.id = "empty";
    els.input.focus();
  });
  els.keyForm.addEventListener("submit", (e) => { e.preventDefault(); keyEntered(els.keyInput.value.trim()); });
  els.keyForget.addEventListener("click", () => keyEntered(""));
  els.keyButton.addEventListener("click", () => askKey(NEEDS_KEY));

  // for tests and the curious: the renderer (into an element, never as HTML) and what was sent
  window.sluiceChat = {
    renderMarkdown,
    transcript: () => state.history.map((m) => ({ role: m.role, content: m.content, dropped: m.dropped })),
  };
  loadModel();
})();
