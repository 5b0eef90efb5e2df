"use strict";
// The chat page's renderer for model text: a small markdown subset (fenced code blocks,
// paragraphs, inline code, bold, italic) built from DOM nodes and textContent, never from HTML,
// so model text can never become markup. Linear time in the length of the text: one pass over
// the lines for blocks, one pass over each paragraph for code spans and emphasis, no regular
// expression that can backtrack, so no reply (however hostile) stalls the page.
(() => {
  const MAX_NESTING = 32;  // deeper emphasis stays literal text
  const BACKTICK = 96;

  function el(tag, text) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  const SPACE = /\s/;
  const PUNCT = /[\p{P}\p{S}]/u;
  const isSpace = (c) => c === "" || SPACE.test(c);  // "" is the start or end of the text
  const isPunct = (c) => c !== "" && PUNCT.test(c);

  // -- inline: code spans, then emphasis in what is left ------------------------------------------

  // Code spans (as CommonMark): a run of n backticks opens one and the next run of exactly n
  // closes it; a run with no closer is literal. Every run is listed once, then each length keeps
  // one pointer into its runs that only moves forward: O(length of the text) in all.
  function codeSpans(text) {
    const runs = [];  // [start, length]
    for (let i = 0; i < text.length;) {
      if (text.charCodeAt(i) !== BACKTICK) { i++; continue; }
      let j = i + 1;
      while (j < text.length && text.charCodeAt(j) === BACKTICK) j++;
      runs.push([i, j - i]);
      i = j;
    }
    const byLength = new Map();  // length -> indices into runs, ascending
    runs.forEach(([, n], k) => {
      let list = byLength.get(n);
      if (!list) byLength.set(n, (list = []));
      list.push(k);
    });
    const next = new Map();  // length -> position in byLength's list
    const spans = [];  // [start, end, content]
    for (let k = 0; k < runs.length; k++) {
      const [start, n] = runs[k];
      const list = byLength.get(n);
      let p = next.get(n) || 0;
      while (p < list.length && list[p] <= k) p++;
      next.set(n, p);
      if (p === list.length) continue;  // no closer: these backticks are text
      const close = list[p];
      spans.push([start, runs[close][0] + n, text.slice(start + n, runs[close][0])]);
      k = close;  // what is between is the span's content
    }
    return spans;
  }

  function codeText(content) {
    // line endings become spaces; one space each side is stripped when both are there (`` `x` ``)
    const t = content.replace(/\n/g, " ");
    return t.length > 2 && t[0] === " " && t[t.length - 1] === " " && t.trim() ? t.slice(1, -1) : t;
  }

  // Emphasis: delimiter runs of * or _ open and close by CommonMark's flanking rules, matched with
  // a stack. A closer takes the nearest opener of its character that fits (** needs **); openers
  // above it are left unmatched (literal), so matches nest. Each opener is pushed and popped once.
  function renderInline(text, parent) {
    const tokens = [];  // {text} | {code} | {delim, tag: null (literal) | "strong" | "em", open}
    const stack = [];   // unmatched openers: {ch, n, token}
    const count = { "*": [0, 0, 0], "_": [0, 0, 0] };  // openers on the stack by character and size

    function delimiterRun(start, end) {
      const ch = text[start];
      const before = start > 0 ? text[start - 1] : "", after = end < text.length ? text[end] : "";
      const left = !isSpace(after) && (!isPunct(after) || isSpace(before) || isPunct(before));
      const right = !isSpace(before) && (!isPunct(before) || isSpace(after) || isPunct(after));
      const canOpen = ch === "*" ? left : left && (!right || isPunct(before));
      const canClose = ch === "*" ? right : right && (!left || isPunct(after));
      let r = end - start;
      while (r > 0) {
        const fits = r >= 2 ? count[ch][1] + count[ch][2] : count[ch][1];
        if (canClose && fits > 0) {
          let f;
          for (;;) {
            f = stack.pop();
            count[f.ch][f.n]--;
            if (f.ch === ch && f.n <= r) break;
          }
          const tag = f.n === 2 ? "strong" : "em";
          f.token.tag = tag;
          tokens.push({ delim: ch.repeat(f.n), tag, open: false });
          r -= f.n;
        } else if (canOpen && stack.length < MAX_NESTING) {
          const n = r >= 2 ? 2 : 1;
          const token = { delim: ch.repeat(n), tag: null, open: true };
          tokens.push(token);
          stack.push({ ch, n, token });
          count[ch][n]++;
          r -= n;
        } else {
          tokens.push({ text: ch.repeat(r) });
          r = 0;
        }
      }
    }

    function scan(from, to) {
      let plain = from;
      for (let i = from; i < to;) {
        const c = text[i];
        if (c !== "*" && c !== "_") { i++; continue; }
        if (i > plain) tokens.push({ text: text.slice(plain, i) });
        let j = i + 1;
        while (j < to && text[j] === c) j++;
        delimiterRun(i, j);
        plain = i = j;
      }
      if (to > plain) tokens.push({ text: text.slice(plain, to) });
    }

    let at = 0;
    for (const [start, end, content] of codeSpans(text)) {
      scan(at, start);
      tokens.push({ code: codeText(content) });
      at = end;
    }
    scan(at, text.length);

    // Build the nodes: matched delimiters open and close elements, all else is text.
    const parents = [parent];
    let pending = "";
    const flush = () => {
      if (pending) parents[parents.length - 1].appendChild(document.createTextNode(pending));
      pending = "";
    };
    for (const t of tokens) {
      if (t.text !== undefined) pending += t.text;
      else if (t.code !== undefined) { flush(); parents[parents.length - 1].appendChild(el("code", t.code)); }
      else if (t.tag === null) pending += t.delim;
      else if (t.open) { flush(); parents.push(parents[parents.length - 1].appendChild(el(t.tag))); }
      else { flush(); parents.pop(); }
    }
    flush();
  }

  // -- blocks: fenced code and paragraphs ---------------------------------------------------------

  function fenceOpen(line) {
    // up to 3 spaces, then 3 or more ` or ~; a backtick fence's info string has no backtick
    let i = 0;
    while (i < 3 && line[i] === " ") i++;
    const ch = line[i];
    if (ch !== "`" && ch !== "~") return null;
    let j = i;
    while (line[j] === ch) j++;
    if (j - i < 3) return null;
    const info = line.slice(j).trim();
    if (ch === "`" && info.includes("`")) return null;
    return { ch, n: j - i, lang: info.split(/\s/, 1)[0] };
  }

  function fenceCloses(line, fence) {
    let i = 0;
    while (i < 3 && line[i] === " ") i++;
    let j = i;
    while (line[j] === fence.ch) j++;
    return j - i >= fence.n && line.slice(j).trim() === "";
  }

  function render(text, parent) {
    parent.replaceChildren();
    const lines = text.split("\n");
    let para = [];
    const flush = () => {
      if (para.length) renderInline(para.join("\n"), parent.appendChild(el("p")));
      para = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const fence = fenceOpen(lines[i]);
      if (fence) {
        flush();
        const code = [];
        for (i++; i < lines.length && !fenceCloses(lines[i], fence); i++) code.push(lines[i]);
        const c = parent.appendChild(el("pre")).appendChild(el("code", code.join("\n")));
        if (fence.lang) c.dataset.lang = fence.lang;  // an attribute value, never markup
      } else if (lines[i].trim() === "") {
        flush();
      } else {
        para.push(lines[i]);
      }
    }
    flush();
  }

  window.sluiceMarkdown = { render };
})();
