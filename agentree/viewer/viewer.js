// agentree view: draws agentree.tree/1 rollout trees top-down as SVG, one card per tree of the
// selected step. Plain browser JavaScript, no libraries, so the page works offline from disk.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("data").textContent);
  const SVGNS = "http://www.w3.org/2000/svg";
  const DX = 74; // horizontal slot of a visible leaf
  const DY = 58; // vertical distance between depths
  const PAD = 36;
  const KINDS = [
    ["expanded", "expanded (branch point)", "diamond", ""],
    ["surviving", "scored, survived", "circle", ""],
    ["pruned", "pruned", "circle", "✕"],
    ["win", "finished: success", "circle", "✓"],
    ["lose", "finished: failure", "circle", ""],
    ["error", "env error / timeout", "circle", "!"],
    ["plain", "turn (not scored)", "small", ""],
    ["root", "root (prompt)", "square", ""],
  ];
  const TOKEN_TREES = new Set(["latr", "treepo", "eptree"]);
  const SHORT = {
    completed: "done",
    max_turns: "max turns",
    max_tokens: "max tokens",
    pruned_low_score: "low score",
    pruned_repeat: "repeat",
    pruned_similar: "similar",
    pruned_repetition: "repetition",
    env_error: "env error",
    timeout: "timeout",
    budget: "budget",
  };

  const state = { step: 0, selected: null, collapsed: new Set(), matches: [], matchAt: -1 };
  const views = []; // per drawn tree: {tree, svg, g, zoom, pos}

  function el(tag, attrs, parent, text) {
    const e = tag.startsWith("svg:")
      ? document.createElementNS(SVGNS, tag.slice(4))
      : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (parent) parent.appendChild(e);
    return e;
  }
  const fmt = (x, d = 2) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
  const signed = (x) => (x >= 0 ? "+" : "") + Number(x).toFixed(2);
  const pct = (x) => (x === undefined || x === null ? "–" : (100 * x).toFixed(1) + "%");

  // -- shapes -------------------------------------------------------------------------------
  function shape(g, kind, r) {
    if (kind === "diamond") {
      const s = r * 1.3;
      return el("svg:path", { class: "shape", d: `M0,${-s}L${s},0L0,${s}L${-s},0Z` }, g);
    }
    if (kind === "square") {
      return el("svg:rect", { class: "shape", x: -r, y: -r, width: 2 * r, height: 2 * r, rx: 2 }, g);
    }
    return el("svg:circle", { class: "shape", r: kind === "small" ? r * 0.6 : r }, g);
  }

  function legend() {
    const box = document.getElementById("legend");
    for (const [cls, label, form, mark] of KINDS) {
      const item = el("div", { class: "item" }, box);
      const svg = el("svg:svg", { width: 22, height: 22, viewBox: "-11 -11 22 22" }, item);
      const kind = cls === "win" || cls === "lose" ? `k-leaf ${cls}` : `k-${cls}`;
      const g = el("svg:g", { class: kind }, svg);
      shape(g, form, 8);
      if (mark) el("svg:text", { class: "mark" }, g, mark);
      el("span", {}, item, label);
    }
    const extra = el("div", { class: "item" }, box);
    el("span", { class: "hint" }, extra,
      "s: process score · R: return · A: advantage · p: branch token probability; " +
      "dashed outline: leaf outside the rollout group");
  }

  // -- layout -------------------------------------------------------------------------------
  function slotWidth(tree) {
    return TOKEN_TREES.has(tree.meta.controller) ? 118 : DX; // room for segment text
  }

  function layout(tree) {
    const nodes = tree.nodes;
    const dx = slotWidth(tree);
    const pos = new Map();
    let slot = 0;
    let maxDepth = 0;
    function visit(id, depth) {
      const n = nodes[id];
      maxDepth = Math.max(maxDepth, depth);
      const kids = state.collapsed.has(key(tree, id)) ? [] : n.children;
      if (!kids.length) {
        pos.set(id, { x: slot++ * dx, y: depth * DY });
        return;
      }
      for (const c of kids) visit(c, depth + 1);
      const xs = kids.map((c) => pos.get(c).x);
      pos.set(id, { x: (Math.min(...xs) + Math.max(...xs)) / 2, y: depth * DY });
    }
    // iterative-safe for the depths we see (<= a few hundred turns)
    visit(0, 0);
    return { pos, width: Math.max(slot - 1, 0) * dx, height: maxDepth * DY };
  }
  const key = (tree, id) => `${tree.file}#${id}`;

  function hiddenCount(tree, id) {
    let n = 0;
    const stack = [...tree.nodes[id].children];
    while (stack.length) {
      const c = stack.pop();
      n += 1;
      stack.push(...tree.nodes[c].children);
    }
    return n;
  }

  // -- drawing ------------------------------------------------------------------------------
  function leafClass(n) {
    if (n.kind !== "leaf") return "";
    return n.success ? " win" : " lose";
  }

  function markOf(n) {
    if (n.kind === "pruned") return "✕";
    if (n.kind === "error") return "!";
    if (n.kind === "leaf" && n.success) return "✓";
    return "";
  }

  function drawNode(layer, tree, n, p, ti) {
    const cls = `node k-${n.kind}${leafClass(n)}${n.end_reason && !n.in_group ? " outside" : ""}`;
    const g = el("svg:g", {
      class: cls,
      "data-node-id": n.id,
      "data-tree": ti,
      transform: `translate(${p.x},${p.y})`,
    }, layer);
    el("svg:circle", { class: "halo", r: 14 }, g);
    const form = n.kind === "expanded" ? "diamond" : n.kind === "root" ? "square"
      : n.kind === "plain" ? "small" : "circle";
    shape(g, form, 9);
    const mark = markOf(n);
    if (mark) el("svg:text", { class: "mark" }, g, mark);
    const title = [`node ${n.id}`, n.end_reason || n.kind];
    if (n.score !== null) title.push(`score ${fmt(n.score)}`);
    if (n.kind !== "root") title.push(`reward ${fmt(n.reward)}`);
    if (n.advantage !== null && n.advantage !== undefined) title.push(`A ${signed(n.advantage)}`);
    el("svg:title", {}, g, title.join(" · "));
    // labels: score (or branch-token probability) to the right, outcome below leaves
    const latr = n.info && n.info.latr;
    if (n.score !== null && n.score !== undefined) {
      el("svg:text", { class: "lbl score", x: 12, y: -6 }, g, `s ${fmt(n.score)}`);
    } else if (latr && latr.p !== undefined) {
      el("svg:text", { class: "lbl score", x: 12, y: -6 }, g, `p ${fmt(latr.p, 3)}`);
    }
    if (TOKEN_TREES.has(tree.meta.controller) && n.action) {
      // token-level trees: the segment's text tells the branches apart
      const text = JSON.stringify(n.action);
      el("svg:text", { class: "lbl seg", x: 12, y: 8 }, g,
        text.length > 13 ? text.slice(0, 12) + "…" : text);
    }
    if (state.collapsed.has(key(tree, n.id)) && n.children.length) {
      el("svg:text", { class: "badge", x: -8, y: 24 }, g, `+${hiddenCount(tree, n.id)}`);
      return;
    }
    if (n.end_reason) {
      const pr = n.kind === "pruned" ? " pruned" : "";
      el("svg:text", { class: "lbl reason" + pr, x: -DX / 2 + 6, y: 24 }, g,
        SHORT[n.end_reason] || n.end_reason);
      el("svg:text", { class: "lbl", x: -DX / 2 + 6, y: 36 }, g, `R ${fmt(n.ret)}`);
      if (n.advantage !== null && n.advantage !== undefined) {
        const sign = n.advantage > 0 ? " pos" : n.advantage < 0 ? " neg" : "";
        el("svg:text", { class: "lbl adv" + sign, x: -DX / 2 + 6, y: 48 }, g,
          `A ${signed(n.advantage)}`);
      }
    }
  }

  function drawTree(tree, ti, card) {
    const { pos, width, height } = layout(tree);
    const dx = slotWidth(tree);
    const cw = width + 2 * PAD + dx;
    const ch = height + 2 * PAD + 40;
    const svg = el("svg:svg", { class: "canvas" }, card);
    const avail = Math.max(card.clientWidth || 900, 300);
    const scale = Math.max(0.35, Math.min(1.25, avail / cw, 640 / ch));
    svg.setAttribute("height", Math.round(Math.min(Math.max(ch * scale, 150), 640)));
    const g = el("svg:g", {}, svg);
    const edges = el("svg:g", {}, g);
    const layer = el("svg:g", {}, g);
    const ox = PAD + dx / 2;
    const oy = PAD;
    for (const n of tree.nodes) {
      if (!pos.has(n.id)) continue;
      const p = pos.get(n.id);
      if (n.parent !== null && pos.has(n.parent)) {
        const q = pos.get(n.parent);
        const my = (q.y + p.y) / 2;
        el("svg:path", {
          class: "edge" + (n.kind === "pruned" ? " to-pruned" : ""),
          "data-edge": `${n.parent}-${n.id}`,
          d: `M${q.x + ox},${q.y + oy}C${q.x + ox},${my + oy} ${p.x + ox},${my + oy} ${p.x + ox},${p.y + oy}`,
        }, edges);
      }
      drawNode(layer, tree, n, { x: p.x + ox, y: p.y + oy }, ti);
    }
    const view = { tree, svg, g, pos, zoom: { k: scale, x: 0, y: 0 }, cw, ch, ox };
    if (cw * scale < avail) view.zoom.x = (avail - cw * scale) / 2;
    applyZoom(view);
    enablePanZoom(view);
    return view;
  }

  function applyZoom(v) {
    v.g.setAttribute("transform", `translate(${v.zoom.x},${v.zoom.y}) scale(${v.zoom.k})`);
  }

  function enablePanZoom(v) {
    const svg = v.svg;
    svg.addEventListener("wheel", (ev) => {
      ev.preventDefault();
      const r = svg.getBoundingClientRect();
      const mx = ev.clientX - r.left;
      const my = ev.clientY - r.top;
      const f = Math.exp(-ev.deltaY * 0.0015);
      const k = Math.min(4, Math.max(0.08, v.zoom.k * f));
      v.zoom.x = mx - ((mx - v.zoom.x) * k) / v.zoom.k;
      v.zoom.y = my - ((my - v.zoom.y) * k) / v.zoom.k;
      v.zoom.k = k;
      applyZoom(v);
    }, { passive: false });
    let drag = null;
    svg.addEventListener("mousedown", (ev) => {
      drag = { x: ev.clientX, y: ev.clientY, zx: v.zoom.x, zy: v.zoom.y, moved: false };
    });
    window.addEventListener("mousemove", (ev) => {
      if (!drag) return;
      const dx = ev.clientX - drag.x;
      const dy = ev.clientY - drag.y;
      if (Math.abs(dx) + Math.abs(dy) > 3) {
        drag.moved = true;
        svg.classList.add("dragging");
      }
      v.zoom.x = drag.zx + dx;
      v.zoom.y = drag.zy + dy;
      applyZoom(v);
    });
    window.addEventListener("mouseup", () => {
      if (drag && drag.moved) svg.dataset.justDragged = "1";
      drag = null;
      svg.classList.remove("dragging");
    });
    svg.addEventListener("click", (ev) => {
      if (svg.dataset.justDragged) {
        delete svg.dataset.justDragged;
        return;
      }
      const g = ev.target.closest("[data-node-id]");
      if (g) select(Number(g.dataset.tree), Number(g.dataset.nodeId));
    });
    svg.addEventListener("dblclick", (ev) => {
      const g = ev.target.closest("[data-node-id]");
      if (g) toggleCollapse(Number(g.dataset.tree), Number(g.dataset.nodeId));
    });
  }

  function centerOn(v, id) {
    const p = v.pos.get(id);
    if (!p) return;
    const w = v.svg.clientWidth || 800;
    const h = v.svg.clientHeight || 400;
    v.zoom.x = w / 2 - (p.x + v.ox) * v.zoom.k;
    v.zoom.y = h / 2 - (p.y + PAD) * v.zoom.k;
    applyZoom(v);
  }

  // -- step / page ----------------------------------------------------------------------------
  function treeStats(tree) {
    const leaves = tree.nodes.filter((n) => n.end_reason);
    const wins = leaves.filter((n) => n.success).length;
    const pruned = leaves.filter((n) => n.kind === "pruned").length;
    const expanded = tree.nodes.filter((n) => n.kind === "expanded").length;
    return { leaves: leaves.length, wins, pruned, expanded };
  }

  function renderStep() {
    const group = DATA.steps[state.step];
    const host = document.getElementById("trees");
    const scroll = host.scrollTop;
    host.textContent = "";
    views.length = 0;
    const list = document.getElementById("treelist");
    list.textContent = "";
    group.trees.forEach((tree, ti) => {
      const s = treeStats(tree);
      const card = el("section", { class: "tree", id: `tree-${ti}` }, host);
      const head = el("header", {}, card);
      el("span", { class: "title" }, head, tree.task_id);
      el("span", { class: "stats" }, head,
        `${tree.nodes.length} nodes · ${s.leaves} leaves · ${s.wins} success · ` +
        `${s.pruned} pruned · ${s.expanded} expanded · ${tree.meta.controller || ""}`);
      const tools = el("span", { class: "tools" }, head);
      const fit = el("button", { title: "fit the tree" }, tools, "fit");
      const more = el("button", { title: "zoom in" }, tools, "+");
      const less = el("button", { title: "zoom out" }, tools, "−");
      const open = el("button", { title: "expand every collapsed node" }, tools, "expand all");
      const v = drawTree(tree, ti, card);
      views.push(v);
      fit.addEventListener("click", () => refit(v));
      more.addEventListener("click", () => { v.zoom.k *= 1.25; applyZoom(v); });
      less.addEventListener("click", () => { v.zoom.k /= 1.25; applyZoom(v); });
      open.addEventListener("click", () => {
        for (const n of tree.nodes) state.collapsed.delete(key(tree, n.id));
        renderStep();
      });
      const li = el("li", {}, list);
      el("div", {}, li, tree.task_id);
      el("div", { class: "sub" }, li, `${tree.nodes.length} nodes, ${s.wins}/${s.leaves} success`);
      li.addEventListener("click", () => card.scrollIntoView({ behavior: "smooth" }));
    });
    host.scrollTop = scroll;
    stepInfo(group);
    if (state.selected && state.selected.step === state.step) {
      markSelected();
    }
    runSearch();
  }

  function refit(v) {
    const w = v.svg.clientWidth || 800;
    const h = v.svg.clientHeight || 400;
    v.zoom.k = Math.max(0.08, Math.min(1.25, w / v.cw, h / v.ch));
    v.zoom.x = (w - v.cw * v.zoom.k) / 2;
    v.zoom.y = 0;
    applyZoom(v);
  }

  function stepInfo(group) {
    const box = document.getElementById("stepinfo");
    box.textContent = "";
    const rows = [];
    const m = group.metrics || {};
    const show = [
      ["train/success_rate", "train success", pct],
      ["train/reward_mean", "reward", (x) => fmt(x)],
      ["train/pruned_frac", "pruned frac", pct],
      ["rollout/env_steps", "env steps", (x) => fmt(x, 0)],
      ["rollout/forks", "forks", (x) => fmt(x, 0)],
      ["train/kl", "KL", (x) => fmt(x, 4)],
      ["eval/success_rate", "held-out success", pct],
    ];
    for (const [k, label, f] of show) if (k in m) rows.push([label, f(m[k])]);
    const s = DATA.summary || {};
    for (const k of ["trajectories", "env_steps", "forks", "expanded", "pruned", "success_rate",
      "resolved_rate", "tasks"]) {
      if (k in s && rows.length < 12) rows.push([k.replace("_", " "), k.endsWith("rate") ? pct(s[k]) : s[k]]);
    }
    if (!rows.length) return;
    el("h3", {}, box, group.label);
    const t = el("table", {}, box);
    for (const [a, b] of rows) {
      const tr = el("tr", {}, t);
      el("td", {}, tr, a);
      el("td", {}, tr, b);
    }
  }

  function header() {
    const run = document.getElementById("run");
    el("b", {}, run, DATA.run);
    const trees = DATA.steps.reduce((a, g) => a + g.trees.length, 0);
    run.appendChild(document.createTextNode(
      ` · ${DATA.kind} · ${trees} trees · advantage: ${(DATA.steps[0].trees[0] || {}).advantage || "–"}`));
    const sel = document.getElementById("step");
    DATA.steps.forEach((g, i) => el("option", { value: i }, sel, `${g.label} (${g.trees.length} trees)`));
    sel.addEventListener("change", () => { state.step = Number(sel.value); renderStep(); });
    const go = (d) => {
      const i = Math.min(DATA.steps.length - 1, Math.max(0, state.step + d));
      if (i !== state.step) { state.step = i; sel.value = i; renderStep(); }
    };
    document.getElementById("prev").addEventListener("click", () => go(-1));
    document.getElementById("next").addEventListener("click", () => go(1));
    document.addEventListener("keydown", (ev) => {
      if (ev.target.tagName === "INPUT" || ev.target.tagName === "SELECT") return;
      if (ev.key === "ArrowLeft") go(-1);
      if (ev.key === "ArrowRight") go(1);
    });
  }

  // -- collapse / select ----------------------------------------------------------------------
  function toggleCollapse(ti, id) {
    const tree = DATA.steps[state.step].trees[ti];
    if (!tree.nodes[id].children.length) return;
    const k = key(tree, id);
    if (state.collapsed.has(k)) state.collapsed.delete(k);
    else state.collapsed.add(k);
    renderStep();
  }

  function markSelected() {
    document.querySelectorAll(".node.selected").forEach((e) => e.classList.remove("selected"));
    document.querySelectorAll(".edge.on-path").forEach((e) => e.classList.remove("on-path"));
    const s = state.selected;
    if (!s) return;
    const svg = views[s.tree] && views[s.tree].svg;
    if (!svg) return;
    const g = svg.querySelector(`[data-node-id="${s.id}"]`);
    if (g) g.classList.add("selected");
    const nodes = DATA.steps[state.step].trees[s.tree].nodes;
    for (let cur = s.id; nodes[cur].parent !== null; cur = nodes[cur].parent) {
      const e = svg.querySelector(`[data-edge="${nodes[cur].parent}-${cur}"]`);
      if (e) e.classList.add("on-path");
    }
  }

  function select(ti, id) {
    state.selected = { step: state.step, tree: ti, id };
    markSelected();
    details(DATA.steps[state.step].trees[ti], ti, id);
  }

  // -- details panel --------------------------------------------------------------------------
  function kv(parent, rows) {
    const t = el("table", { class: "kv" }, parent);
    for (const [k, v] of rows) {
      if (v === undefined) continue;
      const tr = el("tr", {}, t);
      el("td", {}, tr, k);
      el("td", {}, tr, v === null ? "–" : v);
    }
    return t;
  }

  // a turn's parsed calls as name(arg=value, ...) lines (agentree.tools.ToolCall.readable)
  function toolCalls(calls) {
    if (!calls.length) return "(none)";
    return calls.map((c) => {
      const args = Object.entries(c.arguments || {}).map(([k, v]) => `${k}=${JSON.stringify(v)}`);
      return `${c.name}(${args.join(", ")})`;
    }).join("\n");
  }

  function block(parent, title, text, open = true) {
    if (text === null || text === undefined || text === "") return;
    if (open) {
      el("h4", {}, parent, title);
      el("pre", {}, parent, text);
    } else {
      const d = el("details", {}, parent);
      el("summary", {}, d, title);
      el("pre", {}, d, text);
    }
  }

  function depthOf(tree, id) {
    let d = 0;
    for (let cur = id; tree.nodes[cur].parent !== null; cur = tree.nodes[cur].parent) d++;
    return d;
  }

  function details(tree, ti, id) {
    const n = tree.nodes[id];
    const box = document.getElementById("details");
    box.textContent = "";
    el("h2", {}, box, `node ${n.id} · ${tree.task_id}`);
    const line = el("div", {}, box);
    const color = getComputedStyle(document.documentElement)
      .getPropertyValue(`--${n.kind === "leaf" ? (n.success ? "success" : "failed") : n.kind}`);
    const pill = el("span", { class: "pill" }, line, n.kind);
    pill.style.background = color.trim() || "#64748b";
    if (n.end_reason) el("span", { class: "end-reason" }, line, `end reason: ${n.end_reason}`);
    const acts = el("div", { class: "actions" }, box);
    if (n.children.length) {
      const b = el("button", {}, acts,
        state.collapsed.has(key(tree, id)) ? "expand subtree" : "collapse subtree");
      b.addEventListener("click", () => { toggleCollapse(ti, id); details(tree, ti, id); });
    }
    const c = el("button", {}, acts, "center");
    c.addEventListener("click", () => centerOn(views[ti], id));
    kv(box, [
      ["turn / depth", `${n.turn} / ${depthOf(tree, id)}`],
      ["reward", fmt(n.reward, 3)],
      ["return (root → node)", fmt(n.ret, 3)],
      ["process score", n.score === null ? null : fmt(n.score, 4)],
      ["advantage", n.advantage === null || n.advantage === undefined ? null : signed(n.advantage)],
      ["success", n.success === null ? undefined : String(n.success)],
      ["in rollout group", n.end_reason ? String(n.in_group) : undefined],
      ["policy tokens", n.tokens],
      ["sum log-prob", n.logprob === null ? null : fmt(n.logprob, 3)],
      ["observation tokens", n.obs_tokens],
      ["child nodes", n.children.length ? n.children.join(", ") : "none"],
      ["expanded into", n.info.expanded !== undefined ? `${n.info.expanded} children` : undefined],
      ["finish", n.info.finish],
    ]);
    if (id === 0 && tree.task) block(box, "task", JSON.stringify(tree.task, null, 1), false);
    block(box, "action", n.action);
    if (n.info.tool_calls) block(box, "tool calls", toolCalls(n.info.tool_calls));
    if (n.info.tool_error) block(box, "tool call error", n.info.tool_error);
    block(box, "observation", n.observation);
    if (n.info.error) block(box, "error", n.info.error);
    scorer(box, n.info.scorer);
    branchPoint(box, tree, n);
    if (n.info.pruned) {
      el("h4", {}, box, "pruned by lookahead");
      kv(box, Object.entries(n.info.pruned).map(([k, v]) => [k.replace("_", " "), String(v)]));
    }
    if (n.info.env) block(box, "env info", JSON.stringify(n.info.env, null, 1), false);
    block(box, "all node info", JSON.stringify(n.info, null, 1), false);
  }

  function scorer(box, s) {
    if (!s) return;
    el("h4", {}, box, "scorer");
    const rows = [];
    for (const k of ["phase", "judge", "heuristic", "lam", "aggregate", "fallback", "judge_error",
      "error", "steps_seen", "steps_total", "tokens", "attempts", "cached", "latency_s",
      "out_of_range"]) {
      if (k in s) rows.push([k.replace("_", " "), typeof s[k] === "object" ? JSON.stringify(s[k]) : String(s[k])]);
    }
    kv(box, rows);
    if (Array.isArray(s.step_scores) && s.step_scores.length) {
      el("h4", {}, box, `PRM step scores (${s.step_scores.length})`);
      const bars = el("div", { class: "bars" }, box);
      for (const v of s.step_scores) {
        const b = el("div", { title: fmt(v, 3) }, bars);
        b.style.height = `${Math.max(2, 56 * v)}px`;
        el("span", {}, b, fmt(v, 2));
      }
    }
    if (s.reply) block(box, "judge reasoning (reply)", s.reply);
    if (s.signals) block(box, "heuristic signals", JSON.stringify(s.signals, null, 1), false);
    if (s.prompt) block(box, "judge prompt (scorer input)", s.prompt, false);
    if (s.input) block(box, "PRM input", s.input, false);
    const known = new Set(["phase", "judge", "heuristic", "lam", "aggregate", "fallback",
      "judge_error", "error", "steps_seen", "steps_total", "tokens", "attempts", "cached",
      "latency_s", "out_of_range", "step_scores", "reply", "signals", "prompt", "input"]);
    const rest = Object.fromEntries(Object.entries(s).filter(([k]) => !known.has(k)));
    if (Object.keys(rest).length) block(box, "scorer details", JSON.stringify(rest, null, 1), false);
  }

  function branchPoint(box, tree, n) {
    // Token-level trees (LATR): each child after the first carries the candidate token it
    // branched on, its probability p and the top token's probability p_top.
    const kids = n.children.map((c) => tree.nodes[c]);
    const branched = kids.filter((k) => k.info.latr);
    if (branched.length) {
      el("h4", {}, box, "branch point: candidate tokens");
      const pTop = branched[0].info.latr.p_top;
      const cands = [];
      for (const k of kids) {
        const l = k.info.latr;
        cands.push({
          tok: l ? l.token : (branched[0].info.latr.top_token || firstWord(k.action)),
          p: l ? l.p : pTop,
          top: !l,
          node: k.id,
        });
      }
      cands.sort((a, b) => b.p - a.p);
      const t = el("table", { class: "cands" }, box);
      const h = el("tr", {}, t);
      for (const x of ["token", "p", "", "node"]) el("th", {}, h, x);
      for (const c of cands) {
        const tr = el("tr", { class: c.top ? "top" : "" }, t);
        el("td", { class: "tok" }, tr, JSON.stringify(c.tok === undefined ? "?" : c.tok));
        el("td", {}, tr, fmt(c.p, 3));
        const bar = el("div", { class: "pbar" }, el("td", { style: "width:40%" }, tr));
        bar.style.width = `${Math.round(100 * c.p)}%`;
        el("td", {}, tr, c.node);
      }
    }
    const l = n.info.latr;
    if (l) {
      el("h4", {}, box, "branched here");
      kv(box, [
        ["response offset", l.birth],
        ["token", l.token === undefined ? undefined : JSON.stringify(l.token)],
        ["p (this token)", fmt(l.p, 4)],
        ["p (top token)", fmt(l.p_top, 4)],
        ["top token", l.top_token === undefined ? undefined : JSON.stringify(l.top_token)],
      ]);
    }
    for (const k of ["eptree", "arpo_branch", "copy_of", "depth", "fallbacks"]) {
      if (n.info[k] !== undefined) block(box, k.replace("_", " "), JSON.stringify(n.info[k], null, 1));
    }
  }

  function firstWord(s) {
    return s ? s.slice(0, 8) : "";
  }

  // -- search -------------------------------------------------------------------------------
  function runSearch() {
    const q = document.getElementById("search").value.trim().toLowerCase();
    document.querySelectorAll(".node.match").forEach((e) => e.classList.remove("match"));
    state.matches = [];
    const out = document.getElementById("matches");
    if (!q) { out.textContent = ""; return; }
    DATA.steps[state.step].trees.forEach((tree, ti) => {
      for (const n of tree.nodes) {
        const hay = `${n.action || ""}\n${n.observation || ""}\n${n.end_reason || ""}`.toLowerCase();
        if (!hay.includes(q)) continue;
        state.matches.push([ti, n.id]);
        const g = views[ti].svg.querySelector(`[data-node-id="${n.id}"]`);
        if (g) g.classList.add("match");
      }
    });
    out.textContent = `${state.matches.length} matches (Enter: next)`;
  }

  function nextMatch() {
    if (!state.matches.length) return;
    state.matchAt = (state.matchAt + 1) % state.matches.length;
    const [ti, id] = state.matches[state.matchAt];
    const tree = DATA.steps[state.step].trees[ti];
    // a match inside a collapsed subtree is revealed
    let reveal = false;
    for (let cur = tree.nodes[id].parent; cur !== null; cur = tree.nodes[cur].parent) {
      if (state.collapsed.delete(key(tree, cur))) reveal = true;
    }
    if (reveal) renderStep();
    views[ti].svg.scrollIntoView({ block: "nearest" });
    centerOn(views[ti], id);
    select(ti, id);
  }

  function init() {
    legend();
    header();
    const search = document.getElementById("search");
    let timer = null;
    search.addEventListener("input", () => {
      clearTimeout(timer);
      state.matchAt = -1;
      timer = setTimeout(runSearch, 150);
    });
    search.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter") { runSearch(); nextMatch(); }
    });
    if (!DATA.steps.length) return;
    renderStep();
  }
  init();
})();
