// tether's dashboard: polls GET /v1/instances (the JSON `tether status` prints) and renders it in place.
// Vanilla JS, no build step. Every piece of server text goes in through textContent, never as HTML.
// Nodes are keyed and updated in place, so an open <details>, a focused field or a selection survives each poll.
"use strict";

(() => {
  const POLL_MS = 500; // "updates within a second of a change"
  const HIDDEN_POLL_MS = 5000; // a background tab asks rarely
  const STALE_MS = 3000; // no answer for this long: the page says its figures are old
  const CHART_SECONDS = 300; // the charts' span
  const RATE_SECONDS = 2; // tokens/s over the last 2 s of samples
  const REQUEST_TIMEOUT_MS = 10000; // one poll never waits longer
  const KEY_STORAGE = "tether.apiKey";
  const THEME_STORAGE = "tether.theme";

  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------------------------------------------------
  // DOM helpers
  // ------------------------------------------------------------------------------------------------------------

  /** An element: props {class, text, testid, title, hidden, on: {event: fn}, attrs, data}, then its children. */
  function el(tag, props = {}, ...children) {
    const node = tag.startsWith("svg:")
      ? document.createElementNS("http://www.w3.org/2000/svg", tag.slice(4))
      : document.createElement(tag);
    for (const [name, value] of Object.entries(props)) {
      if (value === undefined || value === null) continue;
      if (name === "class") node.setAttribute("class", value);
      else if (name === "text") node.textContent = value;
      else if (name === "testid") node.dataset.testid = value;
      else if (name === "hidden") node.hidden = Boolean(value);
      else if (name === "on") for (const [event, fn] of Object.entries(value)) node.addEventListener(event, fn);
      else if (name === "data") Object.assign(node.dataset, value);
      else if (name === "attrs") for (const [a, v] of Object.entries(value)) node.setAttribute(a, v);
      else node[name] = value;
    }
    for (const child of children.flat()) {
      if (child !== null && child !== undefined && child !== false) {
        node.append(child instanceof Node ? child : String(child));
      }
    }
    return node;
  }

  function setText(node, text) {
    const value = text === null || text === undefined ? "" : String(text);
    if (node.textContent !== value) node.textContent = value;
  }

  function setAttr(node, name, value) {
    if (value === null || value === undefined) node.removeAttribute(name);
    else if (node.getAttribute(name) !== String(value)) node.setAttribute(name, value);
  }

  /** Keep `container`'s children one per item, keyed, in the items' order: create new ones, update all, drop gone. */
  function syncList(container, items, keyOf, create, update) {
    const existing = new Map();
    for (const child of container.children) existing.set(child.dataset.key, child);
    let previous = null;
    for (const item of items) {
      const key = String(keyOf(item));
      let node = existing.get(key);
      if (node) existing.delete(key);
      else {
        node = create(item);
        node.dataset.key = key;
      }
      if (update) update(node, item);
      const wanted = previous ? previous.nextSibling : container.firstChild;
      if (node !== wanted) container.insertBefore(node, wanted);
      previous = node;
    }
    for (const node of existing.values()) node.remove();
  }

  // ------------------------------------------------------------------------------------------------------------
  // Formatting (as tether.units does: binary units, about three significant digits)
  // ------------------------------------------------------------------------------------------------------------

  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

  function bytes(n) {
    if (n === null || n === undefined) return "n/a";
    let value = Math.abs(n);
    let unit = 0;
    while (value >= 1023.5 && unit < UNITS.length - 1) {
      value /= 1024;
      unit += 1;
    }
    const sign = n < 0 ? "-" : "";
    if (unit === 0) return `${sign}${Math.trunc(value)} B`;
    const digits = value < 9.995 ? 2 : value < 99.95 ? 1 : 0;
    return `${sign}${value.toFixed(digits)} ${UNITS[unit]}`;
  }

  function seconds(s) {
    if (s === null || s === undefined) return "–";
    if (s < 0.001) return `${(s * 1e6).toFixed(0)} µs`;
    if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 2 : 1)} ms`;
    if (s < 60) return `${s.toFixed(1)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} d ${Math.round((s % 86400) / 3600)} h`;
  }

  function uptime(s) {
    return s < 60 ? `${Math.floor(s)} s` : seconds(s);
  }

  function clock(epochSeconds) {
    const d = new Date(epochSeconds * 1000);
    const pad = (n) => String(n).padStart(2, "0");
    const today = new Date().toDateString() === d.toDateString();
    const time = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
    return today ? time : `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${time}`;
  }

  function rate(value) {
    if (value === null || value === undefined) return "–";
    if (value === 0) return "0";
    return value >= 100 ? value.toFixed(0) : value >= 10 ? value.toFixed(1) : value.toFixed(2);
  }

  // Speculative decoding on an instance (its ended generations): drafted tokens kept, and completion tokens per engine
  // step; null for both while it has drafted nothing (an engine that does not speculate, or speculation off).
  function drafting(spec) {
    if (!spec || !(spec.draft_tokens > 0)) return null;
    return {
      kept: `${((100 * spec.accepted_tokens) / spec.draft_tokens).toFixed(0)} %`,
      perStep: spec.decode_steps > 0 ? (spec.completion_tokens / spec.decode_steps).toFixed(2) : "–",
    };
  }

  function plural(n, word) {
    return `${n} ${word}${n === 1 ? "" : "s"}`;
  }

  // ------------------------------------------------------------------------------------------------------------
  // The API: the key, errors in both of the server's shapes, 401 → the login form
  // ------------------------------------------------------------------------------------------------------------

  let apiKey = sessionStorage.getItem(KEY_STORAGE);

  class ApiError extends Error {
    constructor(status, message, body) {
      super(message);
      this.status = status;
      this.body = body;
    }
  }

  function errorMessage(status, body, text) {
    const error = body && body.error;
    if (error && typeof error === "object" && error.message) return error.message; // OpenAI's shape
    if (typeof error === "string") return error; // Ollama's shape
    return text ? text.slice(0, 300) : `HTTP ${status}`;
  }

  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), REQUEST_TIMEOUT_MS);
    let response;
    let text;
    try {
      response = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: controller.signal,
        cache: "no-store",
      });
      text = await response.text();
    } catch (exc) {
      const why = exc.name === "AbortError" ? `no answer within ${REQUEST_TIMEOUT_MS / 1000} s` : exc.message;
      throw new ApiError(0, `cannot reach the server: ${why}`, null);
    } finally {
      clearTimeout(timer);
    }
    let parsed = null;
    try {
      parsed = text ? JSON.parse(text) : null;
    } catch {
      parsed = null;
    }
    if (response.status === 401) {
      needLogin(errorMessage(401, parsed, text));
      throw new ApiError(401, errorMessage(401, parsed, text), parsed);
    }
    if (!response.ok) throw new ApiError(response.status, errorMessage(response.status, parsed, text), parsed);
    return parsed;
  }

  // ------------------------------------------------------------------------------------------------------------
  // Login: no data on the page until the server accepts the key
  // ------------------------------------------------------------------------------------------------------------

  let loginTried = false; // a key was entered in this tab: a 401 now means it is wrong

  function needLogin(message) {
    const hadKey = Boolean(apiKey);
    if (hadKey) {
      apiKey = null;
      sessionStorage.removeItem(KEY_STORAGE);
    }
    clearData();
    $("app").hidden = true;
    $("login").hidden = false;
    $("logout").hidden = true;
    const error = $("login-error");
    error.hidden = !hadKey && !loginTried;
    if (hadKey || loginTried) error.textContent = `The server refused the key: ${message}`;
    setConnection("login", "API key needed");
    $("login-key").focus();
  }

  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("login-key").value.trim();
    if (!value) return;
    apiKey = value;
    loginTried = true;
    sessionStorage.setItem(KEY_STORAGE, value);
    $("login-key").value = "";
    pollNow();
  });

  $("logout").addEventListener("click", () => {
    apiKey = null;
    loginTried = false;
    sessionStorage.removeItem(KEY_STORAGE);
    clearData();
    needLogin("logged out");
  });

  function showApp() {
    $("login").hidden = true;
    $("app").hidden = false;
    $("logout").hidden = !apiKey;
  }

  // ------------------------------------------------------------------------------------------------------------
  // Theme: the system's until the user picks one (kept in localStorage)
  // ------------------------------------------------------------------------------------------------------------

  const THEMES = ["auto", "light", "dark"];

  function applyTheme(theme) {
    if (theme === "auto") delete document.documentElement.dataset.theme;
    else document.documentElement.dataset.theme = theme;
    $("theme").textContent = `theme: ${theme}`;
  }

  let theme = localStorage.getItem(THEME_STORAGE) || "auto";
  if (!THEMES.includes(theme)) theme = "auto";
  applyTheme(theme);
  $("theme").addEventListener("click", () => {
    theme = THEMES[(THEMES.indexOf(theme) + 1) % THEMES.length];
    localStorage.setItem(THEME_STORAGE, theme);
    applyTheme(theme);
  });

  // ------------------------------------------------------------------------------------------------------------
  // Toasts and the confirmation dialog
  // ------------------------------------------------------------------------------------------------------------

  function toast(kind, title, message) {
    const box = $("toasts");
    const node = el(
      "div",
      { class: `toast ${kind}`, testid: "toast", data: { kind }, attrs: { role: kind === "error" ? "alert" : "status" } },
      el("div", { class: "toast-title", text: title }),
      message ? el("div", { class: "toast-body", testid: "toast-body", text: message }) : null,
      el("button", { type: "button", class: "toast-close", text: "×", title: "dismiss", on: { click: () => node.remove() } }),
    );
    box.append(node);
    while (box.children.length > 5) box.firstChild.remove();
    setTimeout(() => node.remove(), kind === "error" ? 20000 : 8000);
  }

  /** Ask before acting: resolves true on OK, false on Cancel or Escape. */
  function confirmAction(title, body, okLabel = "OK") {
    const dialog = $("confirm");
    setText($("confirm-title"), title);
    setText($("confirm-body"), body);
    setText($("confirm-ok"), okLabel);
    return new Promise((resolve) => {
      const done = (answer) => {
        $("confirm-ok").removeEventListener("click", ok);
        $("confirm-cancel").removeEventListener("click", cancel);
        dialog.removeEventListener("cancel", cancel);
        if (dialog.open) dialog.close();
        resolve(answer);
      };
      const ok = () => done(true);
      const cancel = (event) => {
        if (event) event.preventDefault();
        done(false);
      };
      $("confirm-ok").addEventListener("click", ok);
      $("confirm-cancel").addEventListener("click", cancel);
      dialog.addEventListener("cancel", cancel);
      dialog.showModal();
      $("confirm-cancel").focus();
    });
  }

  /** Confirm, run `call`, toast its outcome (the server's words, errors included), then poll at once. */
  async function act({ title, body, okLabel, call, done }) {
    if (!(await confirmAction(title, body, okLabel))) return null;
    try {
      const answer = await call();
      toast("ok", title.replace(/\?$/, ""), done(answer));
      return answer;
    } catch (exc) {
      if (exc.status !== 401) toast("error", `${title.replace(/\?$/, "")}: failed${exc.status ? ` (${exc.status})` : ""}`, exc.message);
      return null;
    } finally {
      pollNow();
    }
  }

  // ------------------------------------------------------------------------------------------------------------
  // The log panel
  // ------------------------------------------------------------------------------------------------------------

  async function showLog(instanceId, life) {
    const dialog = $("log");
    setText($("log-title"), `${instanceId}: runner log${life ? ` of life ${life}` : " (current life)"}`);
    setText($("log-meta"), "loading…");
    setText($("log-lines"), "");
    if (!dialog.open) dialog.showModal();
    const query = new URLSearchParams({ lines: "200" });
    if (life) query.set("life", String(life));
    try {
      const answer = await api("GET", `/v1/instances/${encodeURIComponent(instanceId)}/log?${query}`);
      const lines = answer.lines || [];
      setText(
        $("log-meta"),
        `${answer.path} · life ${answer.life} · ${plural(lines.length, "line")}${answer.truncated ? " (the last ones: the file has more)" : ""}`,
      );
      setText($("log-lines"), lines.length ? lines.join("\n") : "(empty)");
      const pre = $("log-lines");
      pre.scrollTop = pre.scrollHeight;
      dialog.dataset.state = "loaded";
    } catch (exc) {
      setText($("log-meta"), "");
      setText($("log-lines"), `could not read the log: ${exc.message}`);
      dialog.dataset.state = "error";
    }
  }

  $("log-close").addEventListener("click", () => $("log").close());

  // ------------------------------------------------------------------------------------------------------------
  // Time series per instance: tokens/s and memory, for the charts
  // ------------------------------------------------------------------------------------------------------------

  const series = new Map(); // instance id → {samples: [{t, tokens, tps, footprint, rss}], marks: [{t, label}], lives}
  const restartSeen = new Map(); // `${id}:${life}:${attempt}` → when the page first saw that backoff (ms)

  function record(inst, now) {
    let s = series.get(inst.id);
    if (!s) {
      s = { samples: [], marks: [], failures: null };
      series.set(inst.id, s);
    }
    const memory = (inst.runner && inst.runner.memory) || null;
    const tokens = typeof inst.tokens === "number" ? inst.tokens : null;
    const last = s.samples[s.samples.length - 1];
    if (last && tokens !== null && last.tokens !== null && tokens < last.tokens) s.samples.length = 0; // a new instance
    let tps = null;
    if (tokens !== null) {
      let base = null;
      for (let i = s.samples.length - 1; i >= 0; i--) {
        base = s.samples[i];
        if (now - base.t >= RATE_SECONDS * 1000) break;
      }
      if (base && base.tokens !== null && now > base.t) tps = ((tokens - base.tokens) * 1000) / (now - base.t);
    }
    s.samples.push({
      t: now,
      tokens,
      tps,
      footprint: memory ? memory.footprint : null,
      rss: memory ? memory.rss : null,
    });
    while (s.samples.length && now - s.samples[0].t > CHART_SECONDS * 1000) s.samples.shift();
    const failures = (inst.history || []).length;
    if (s.failures !== null && failures > s.failures) s.marks.push({ t: now, label: "failure" });
    s.failures = failures;
    while (s.marks.length && now - s.marks[0].t > CHART_SECONDS * 1000) s.marks.shift();
    return s;
  }

  const CHART_W = 300;
  const CHART_H = 56;

  function niceMax(value) {
    if (!(value > 0)) return 1;
    const step = 10 ** Math.floor(Math.log10(value));
    for (const m of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (value <= m * step) return m * step;
    return 10 * step;
  }

  function makeChart(title, testid, lines) {
    const svg = el("svg:svg", {
      class: "chart-svg",
      attrs: { viewBox: `0 0 ${CHART_W} ${CHART_H}`, preserveAspectRatio: "none", role: "img", "aria-label": title },
    });
    const grid = el("svg:g", { class: "chart-grid" });
    for (const y of [0.25, 0.5, 0.75]) {
      grid.append(el("svg:line", { attrs: { x1: 0, x2: CHART_W, y1: CHART_H * y, y2: CHART_H * y } }));
    }
    svg.append(grid);
    const marks = el("svg:g", { class: "chart-marks" });
    svg.append(marks);
    const paths = {};
    for (const line of lines) {
      if (line.area) {
        paths[`${line.field}-area`] = el("svg:path", { class: `chart-area ${line.class}` });
        svg.append(paths[`${line.field}-area`]);
      }
      paths[line.field] = el("svg:path", { class: `chart-line ${line.class}`, attrs: { "vector-effect": "non-scaling-stroke" } });
      svg.append(paths[line.field]);
    }
    const now = el("span", { class: "chart-now" });
    const since = el("span");
    const max = el("span", { class: "chart-max muted" });
    const legend = el(
      "div",
      { class: "chart-head" },
      el("span", { class: "chart-title", text: title }),
      now,
      el("span", { class: "spacer" }),
      max,
    );
    const box = el(
      "figure",
      { class: "chart", testid },
      legend,
      svg,
      el("div", { class: "chart-axis muted" }, since, el("span", { text: "now" })),
    );
    return { box, svg, marks, paths, now, max, lines, since };
  }

  function drawChart(chart, samples, marks, nowMs, format) {
    // The span grows with the samples from one minute to CHART_SECONDS, so a fresh page is not a flat line.
    const seen = samples.length ? (nowMs - samples[0].t) / 1000 : 0;
    const span = Math.min(CHART_SECONDS, Math.max(60, Math.ceil(seen / 60) * 60));
    const start = nowMs - span * 1000;
    const x = (t) => ((t - start) / (span * 1000)) * CHART_W;
    setText(chart.since, `${span / 60} min ago`);
    let top = 0;
    for (const line of chart.lines) for (const s of samples) if (s[line.field] !== null) top = Math.max(top, s[line.field]);
    const ceiling = niceMax(top);
    const y = (v) => CHART_H - (v / ceiling) * (CHART_H - 2) - 1;
    for (const line of chart.lines) {
      let d = "";
      let area = "";
      let run = [];
      const flush = () => {
        if (!run.length) return;
        d += run.map((p, i) => `${i ? "L" : "M"}${p[0].toFixed(1)},${p[1].toFixed(1)}`).join("");
        area += `M${run[0][0].toFixed(1)},${CHART_H}` + run.map((p) => `L${p[0].toFixed(1)},${p[1].toFixed(1)}`).join("") + `L${run[run.length - 1][0].toFixed(1)},${CHART_H}Z`;
        run = [];
      };
      for (const s of samples) {
        const v = s[line.field];
        if (v === null || v === undefined) flush();
        else run.push([x(s.t), y(v)]);
      }
      flush();
      setAttr(chart.paths[line.field], "d", d || "M0,0");
      if (line.area) setAttr(chart.paths[`${line.field}-area`], "d", area || "M0,0");
    }
    chart.marks.replaceChildren(
      ...marks.map((m) => el("svg:line", { class: "chart-mark", attrs: { x1: x(m.t), x2: x(m.t), y1: 0, y2: CHART_H, "vector-effect": "non-scaling-stroke" } }, el("svg:title", { text: m.label }))),
    );
    const last = samples[samples.length - 1];
    const first = chart.lines[0].field;
    setText(chart.now, last ? format(last[first]) : "–");
    setText(chart.max, top > 0 ? `max ${format(top)}` : "");
  }

  // ------------------------------------------------------------------------------------------------------------
  // Rendering
  // ------------------------------------------------------------------------------------------------------------

  function clearData() {
    for (const id of ["glance", "nodes", "instances", "failure-groups", "catalog-rows", "decisions", "cluster-events"]) {
      $(id).replaceChildren();
    }
    series.clear();
    restartSeen.clear();
    setText($("server"), "");
    $("failure-count").hidden = true;
  }

  function memoryBar(used, total, testid) {
    const fraction = total > 0 ? Math.min(Math.max(used / total, 0), 1) : 0;
    const bar = el("div", { class: "bar", testid, attrs: { role: "meter", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": Math.round(fraction * 100) } }, el("div", { class: "bar-fill" }));
    bar.firstChild.style.width = `${(fraction * 100).toFixed(1)}%`;
    bar.dataset.level = fraction > 0.9 ? "high" : fraction > 0.75 ? "mid" : "low";
    return bar;
  }

  function renderNodes(data) {
    const nodes = [];
    const node = data.node;
    if (node) {
      nodes.push({
        key: "worker",
        title: data.cluster ? "coordinator (this machine)" : "this machine",
        subtitle: `worker pid ${node.pid} · tether ${node.version} · up ${uptime(node.uptime)}`,
        state: null,
        memory: node.memory,
        gpus: node.gpus,
        gpuReason: node.gpu_reason,
        runners: null,
      });
    }
    for (const n of (data.cluster && data.cluster.nodes) || []) {
      const report = n.memory;
      nodes.push({
        key: `node-${n.node}`,
        title: `node ${n.node.slice(0, 8)}${n.host ? ` · ${n.host}` : ""}`,
        subtitle: `agent pid ${n.agent_pid ?? "–"} · heard ${seconds(n.heard_ago)} ago${n.cause ? ` · ${n.cause}` : ""}`,
        state: n.state,
        memory: report ? { available: report.available, total: report.cgroup_limit ?? report.host_total, source: report.source } : null,
        gpus: null,
        gpuReason: null,
        runners: n.runners,
      });
    }
    syncList(
      $("nodes"),
      nodes,
      (n) => n.key,
      () =>
        el(
          "article",
          { class: "card node", testid: "node" },
          el("header", {}, el("h3", { class: "node-title" }), el("span", { class: "badge node-state" })),
          el("div", { class: "muted small node-sub" }),
          el("div", { class: "node-memory" }),
          el("div", { class: "node-gpus" }),
          el("div", { class: "muted small node-runners" }),
        ),
      (card, n) => {
        setText(card.querySelector(".node-title"), n.title);
        const badge = card.querySelector(".node-state");
        badge.hidden = !n.state;
        setText(badge, n.state || "");
        badge.dataset.state = n.state || "";
        setText(card.querySelector(".node-sub"), n.subtitle);
        const mem = card.querySelector(".node-memory");
        if (n.memory) {
          const m = n.memory;
          const used = m.total - m.available;
          mem.replaceChildren(
            el(
              "div",
              { class: "node-figure" },
              el("span", { class: "big", testid: "node-available", text: bytes(m.available) }),
              el("span", { class: "muted", text: ` available of ${bytes(m.total)}` }),
            ),
            memoryBar(used, m.total, "node-memory-bar"),
            el("div", { class: "muted small", testid: "node-memory-source", text: `measured from ${m.source}` }),
          );
        } else mem.replaceChildren(el("div", { class: "muted small", text: "no memory report yet" }));
        const gpus = card.querySelector(".node-gpus");
        if (n.gpus && n.gpus.length) {
          gpus.replaceChildren(
            ...n.gpus.map((g) =>
              el(
                "div",
                { class: "gpu", testid: "node-gpu" },
                el("div", { class: "small" }, el("strong", { text: `GPU ${g.index}` }), ` ${g.name}: ${bytes(g.used)} used of ${bytes(g.total)}`),
                memoryBar(g.used, g.total, "node-gpu-bar"),
              ),
            ),
          );
        } else if (n.gpuReason) gpus.replaceChildren(el("div", { class: "muted small", text: `no GPU figures (${n.gpuReason})` }));
        else gpus.replaceChildren();
        setText(card.querySelector(".node-runners"), n.runners ? `runners: ${n.runners.join(", ") || "none"}` : "");
      },
    );
  }

  function stat(label, testid, title) {
    return el("div", { class: "stat", title }, el("div", { class: "stat-label", text: label }), el("div", { class: "stat-value", testid }));
  }

  function createInstance(inst) {
    const id = inst.id;
    const tps = makeChart("tokens/s", "chart-tps", [{ field: "tps", class: "c1", area: true }]);
    const mem = makeChart("memory", "chart-memory", [
      { field: "footprint", class: "c2", area: true },
      { field: "rss", class: "c3 dashed" },
    ]);
    mem.box.querySelector(".chart-head").append(
      el("span", { class: "legend" }, el("i", { class: "swatch c2" }), "footprint ", el("i", { class: "swatch c3 dashed" }), "RSS"),
    );
    const card = el(
      "article",
      { class: "card instance", testid: "instance", data: { instance: id } },
      el(
        "header",
        {},
        el("h3", { testid: "instance-id", text: id }),
        el("span", { class: "badge", testid: "instance-state" }),
        el("span", { class: "muted small model", testid: "instance-model" }),
        el("span", { class: "spacer" }),
        el("button", { type: "button", class: "ghost", testid: "instance-log", text: "log", title: "the runner log of the current life", on: { click: () => showLog(id, null) } }),
        el("button", { type: "button", class: "danger", testid: "instance-stop", text: "stop", on: { click: () => stopInstance(id) } }),
      ),
      el("p", { class: "reason", testid: "instance-reason", hidden: true }),
      el(
        "div",
        { class: "stats" },
        stat("runner pid", "instance-pid"),
        stat("life", "instance-life", "the runner's life: 1 for the first, one more for each restart"),
        stat("restarts", "instance-restarts"),
        stat("resumed", "instance-resumed", "requests that went on from where they stopped on a new runner after theirs died; after the slash, those that could not and failed with the cause (and quarantined: proven to kill their runner)"),
        stat("prompt store", "instance-store", "saved prompts kept on tmpfs beyond the runner, so a resumed request restores its prompt instead of reading it again: memory the instance holds beside the runner's footprint, freed with the instance"),
        stat("backoff", "instance-backoff", "time left before the next life starts, while restarting"),
        stat("running", "instance-running", "generations running / batch slots (parallel)"),
        stat("waiting", "instance-waiting", "generations waiting / the queue's bound (max_queue): beyond it, 503"),
        stat("tokens/s", "instance-tps", `completion tokens per second over the last ${RATE_SECONDS} s, streams in flight included`),
        stat("footprint", "instance-footprint", "what stopping the runner frees: anonymous + shmem + swap + GPU memory (mapped files are page cache)"),
        stat("RSS", "instance-rss", "resident set: counts mapped weight files, misses GPU/unified memory"),
        stat("VRAM", "instance-vram", "GPU memory the runner holds, from NVML (– where there is no NVIDIA GPU or NVML cannot say)"),
        stat("GPU layers", "instance-gpu-layers", "layers on the GPU of the model's layers (the output layer counts as one), as the fit check placed them"),
        stat("drafts kept", "instance-drafts-kept", "speculative decoding: of the tokens drafted and verified, the share the model kept (ended generations; – while nothing was drafted)"),
        stat("tokens/step", "instance-tokens-per-step", "speculative decoding: completion tokens per engine step, above 1 when drafts are kept (ended generations; – while nothing was drafted)"),
      ),
      el("div", { class: "charts" }, tps.box, mem.box),
      el("div", { class: "sub requests", testid: "instance-requests", hidden: true }),
      el("div", { class: "sub ranks", testid: "instance-ranks", hidden: true }),
      el("div", { class: "sub replicas", testid: "instance-replicas", hidden: true }),
      el("p", { class: "muted small fit", testid: "instance-fit" }),
    );
    card._charts = { tps, mem };
    return card;
  }

  function backoff(inst, nowMs) {
    if (inst.state !== "restarting" || !inst.detail) return null;
    const d = inst.detail;
    const key = `${inst.id}:${d.life}:${d.attempt}`;
    // The server says how long is left (on its clock, when it answered): counted down here until the next answer.
    // An older server said it only in words; failing both, the delay from when this page first saw the backoff
    // (which overstates it by at most one poll).
    const said = /restarting in ([0-9.]+) s/.exec(inst.reason || "");
    if (typeof inst.backoff_remaining === "number") restartSeen.set(key, { at: nowMs, left: inst.backoff_remaining });
    else if (said) restartSeen.set(key, { at: nowMs, left: parseFloat(said[1]) });
    else if (!restartSeen.has(key)) restartSeen.set(key, { at: nowMs, left: d.delay });
    const seen = restartSeen.get(key);
    const left = Math.max(seen.left - (nowMs - seen.at) / 1000, 0);
    return { left, delay: d.delay, attempt: d.attempt };
  }

  function table(headers, rows) {
    return el(
      "table",
      { class: "table" },
      el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { text: h })))),
      el("tbody", {}, ...rows.map((r) => el("tr", {}, ...r.map((c) => (c instanceof Node ? el("td", {}, c) : el("td", { text: c })))))),
    );
  }

  function updateInstance(card, inst, nowMs) {
    const s = record(inst, nowMs);
    card.dataset.state = inst.state;
    card.dataset.ready = String(Boolean(inst.ready));
    const badge = card.querySelector('[data-testid="instance-state"]');
    setText(badge, inst.state);
    badge.dataset.state = inst.state;
    const model = inst.model ? inst.model.split("/").pop() : "default model";
    setText(card.querySelector('[data-testid="instance-model"]'), `${inst.engine} · ${model}`);
    card.querySelector('[data-testid="instance-model"]').title = inst.model || "the built-in default model";
    const reason = card.querySelector('[data-testid="instance-reason"]');
    reason.hidden = Boolean(inst.ready);
    const wait = backoff(inst, nowMs);
    let reasonText = inst.reason || "";
    if (wait) reasonText = reasonText.replace(/restarting in [0-9.]+ s/, `restarting in ${wait.left.toFixed(1)} s`);
    setText(reason, reasonText);
    reason.dataset.state = inst.state;

    const runner = inst.runner || {};
    const memory = runner.memory || null;
    const q = inst.queue || {};
    const put = (testid, text) => setText(card.querySelector(`[data-testid="${testid}"]`), text);
    put("instance-pid", runner.pid ?? "–");
    card.querySelector('[data-testid="instance-pid"]').title = inst.pids && inst.pids.length > 1 ? `every life's runner pid: ${inst.pids.join(", ")}` : "";
    put("instance-life", inst.life ?? (inst.detail && inst.detail.life) ?? "–");
    put("instance-restarts", inst.restarts);
    const r = inst.resumes || {};
    put(
      "instance-resumed",
      r.enabled === false ? "off" : `${r.resumed ?? 0} / ${r.not_resumed ?? 0}${r.quarantined ? ` · ${r.quarantined} quarantined` : ""}`,
    );
    put("instance-store", r.enabled === false ? "off" : bytes(r.store_bytes ?? 0));
    put(
      "instance-backoff",
      wait ? (wait.left > 0 ? `${wait.left.toFixed(1)} s` : "due") : "–",
    );
    card.querySelector('[data-testid="instance-backoff"]').title = wait
      ? `life ${inst.detail.life} starts after a backoff of ${wait.delay.toFixed(1)} s (failure ${wait.attempt} in a row), once the old runner's process group is gone`
      : "";
    put("instance-running", `${q.running ?? 0} of ${q.parallel ?? "?"}`);
    put("instance-waiting", `${q.waiting ?? 0} of ${q.max_queue ?? "?"}`);
    const last = s.samples[s.samples.length - 1];
    put("instance-tps", typeof inst.tokens === "number" ? rate(last.tps) : "n/a");
    const drafts = drafting(inst.speculation);
    put("instance-drafts-kept", drafts ? drafts.kept : "–");
    put("instance-tokens-per-step", drafts ? drafts.perStep : "–");
    put("instance-footprint", memory ? bytes(memory.footprint) : "–");
    put("instance-rss", memory ? bytes(memory.rss) : "–");
    put("instance-vram", memory && typeof memory.gpu === "number" ? bytes(memory.gpu) : "–");
    put("instance-gpu-layers", inst.offload ? `${inst.offload.n_gpu_layers} of ${inst.offload.layers}` : "–");

    drawChart(card._charts.tps, s.samples, s.marks, nowMs, rate);
    drawChart(card._charts.mem, s.samples, s.marks, nowMs, bytes);

    // Requests being served now: each can be cancelled.
    const requests = card.querySelector('[data-testid="instance-requests"]');
    const flying = inst.in_flight_requests || [];
    requests.hidden = flying.length === 0;
    if (!requests.firstChild) requests.append(el("h4", { class: "sub-title" }), el("ul", { class: "request-list" }));
    setText(requests.firstChild, `${plural(flying.length, "request")} in flight`);
    {
      syncList(
        requests.lastChild,
        flying,
        (r) => r.id,
        (r) =>
          el(
            "li",
            { class: "request", testid: "request", data: { request: r.id } },
            el("code", { text: r.id }),
            el("span", { class: "muted small request-tokens" }),
            el("span", { class: "spacer" }),
            el("button", { type: "button", class: "ghost small", testid: "request-cancel", text: "cancel", on: { click: () => cancelRequest(inst.id, r.id) } }),
          ),
        (node, r) => {
          const where = inst.replicas && inst.replicas.length > 1 ? ` on ${r.replica}` : "";
          setText(node.querySelector(".request-tokens"), `${plural(r.tokens, "token")} so far${where}`);
        },
      );
    }

    const ranks = card.querySelector('[data-testid="instance-ranks"]');
    ranks.hidden = !(inst.ranks && inst.ranks.length);
    if (inst.ranks && inst.ranks.length) {
      const rows = inst.ranks.map((r) => [
        `rank ${r.rank}`,
        r.address || "–",
        r.node ? r.node.slice(0, 8) : "this machine",
        r.pid ?? "–",
        r.alive ? r.status || "alive" : "gone",
      ]);
      ranks.replaceChildren(el("h4", { class: "sub-title", text: `${inst.ranks.length} ranks (requests go to rank 0)` }), table(["rank", "address", "node", "pid", "status"], rows));
    }
    const replicas = card.querySelector('[data-testid="instance-replicas"]');
    const many = inst.replicas && inst.replicas.length > 1;
    replicas.hidden = !many;
    if (many) {
      const rows = inst.replicas.map((r) => [
        r.name,
        r.state,
        r.node ? r.node.slice(0, 8) : "this machine",
        r.pid ?? "–",
        String(r.serving),
        String(r.restarts),
        r.cause ? r.cause.summary : "",
      ]);
      replicas.replaceChildren(
        el("h4", { class: "sub-title", text: `${inst.replicas.length} replicas (spread ${inst.spread})` }),
        table(["replica", "state", "node", "pid", "serving", "restarts", "last cause"], rows),
      );
    }
    setText(card.querySelector('[data-testid="instance-fit"]'), [inst.measured, inst.fit].filter(Boolean).join(" · "));
  }

  function renderInstances(instances, nowMs) {
    syncList($("instances"), instances, (i) => i.id, createInstance, (card, inst) => updateInstance(card, inst, nowMs));
    for (const id of [...series.keys()]) if (!instances.some((i) => i.id === id)) series.delete(id);
    $("no-instances").hidden = instances.length > 0;
    const ready = instances.filter((i) => i.ready).length;
    setText($("instances-summary"), instances.length ? `${ready} of ${instances.length} ready` : "");
  }

  function createFailure(instanceId, f) {
    const c = f.cause || {};
    const facts = [
      clock(f.at),
      `life ${f.life}`,
      f.pid ? `pid ${f.pid}` : null,
      c.phase ? `while ${c.phase}` : null,
      c.signal ? `signal ${c.signal}` : null,
      c.exit_code !== null && c.exit_code !== undefined ? `exit code ${c.exit_code}` : null,
      c.rank !== null && c.rank !== undefined ? `rank ${c.rank}` : null,
      f.detected_in !== null && f.detected_in !== undefined ? `requests failed ${seconds(f.detected_in)} after the end` : null,
    ].filter(Boolean);
    const evidence = c.evidence || [];
    const full = [
      ["cause", c.kind],
      ["signal", c.signal],
      ["exit code", c.exit_code],
      ["phase", c.phase],
      ["rank", c.rank],
      ["life", f.life],
      ["pid", f.pid],
      ["at", new Date(f.at * 1000).toLocaleString()],
      ["requests failed after", f.detected_in !== null && f.detected_in !== undefined ? seconds(f.detected_in) : null],
      ["runner log", f.log],
    ].filter(([, v]) => v !== null && v !== undefined && v !== "");
    return el(
      "li",
      { class: "failure", testid: "failure", data: { instance: instanceId, life: String(f.life), kind: c.kind || "" } },
      el(
        "div",
        { class: "failure-head" },
        el("span", { class: "badge kind", testid: "failure-kind", data: { kind: c.kind || "" }, text: c.kind || "unknown" }),
        el("span", { class: "failure-summary", testid: "failure-summary", text: c.summary || "(no summary)" }),
      ),
      el("div", { class: "muted small failure-meta", testid: "failure-meta", text: facts.join(" · ") }),
      el(
        "div",
        { class: "failure-actions" },
        el(
          "details",
          { class: "evidence", testid: "failure-evidence" },
          el("summary", { text: evidence.length ? `evidence: ${plural(evidence.length, "line")}` : "evidence: the facts (no output lines)" }),
          el("dl", { class: "facts", testid: "failure-facts" }, ...full.map(([k, v]) => el("div", {}, el("dt", { text: k }), el("dd", { text: String(v) })))),
          evidence.length
            ? el("pre", { class: "evidence-lines", testid: "failure-evidence-lines", text: evidence.join("\n") })
            : el("p", { class: "muted small", testid: "failure-no-lines", text: "The runner wrote nothing to stderr before it ended (no traceback, stack or engine line to show); its log of this life may say more." }),
        ),
        el("button", {
          type: "button",
          class: "ghost small",
          testid: "failure-log",
          text: `runner log of life ${f.life}`,
          disabled: !f.log && f.log !== undefined,
          title: f.log || "no log file was kept for this life",
          on: { click: () => showLog(instanceId, f.life) },
        }),
      ),
    );
  }

  function renderFailures(instances) {
    const groups = instances.filter((i) => (i.history || []).length);
    let total = 0;
    syncList(
      $("failure-groups"),
      groups,
      (i) => i.id,
      (inst) =>
        el(
          "div",
          { class: "card failure-group", testid: "failure-group", data: { instance: inst.id } },
          el("h3", {}, el("span", { text: inst.id }), " ", el("span", { class: "muted small group-counts" })),
          el("ol", { class: "failure-list" }),
        ),
      (group, inst) => {
        const history = [...inst.history].sort((a, b) => b.at - a.at || b.life - a.life);
        total += history.length;
        const kinds = Object.entries(inst.failures || {})
          .map(([kind, n]) => `${kind} ${n}`)
          .join(", ");
        setText(group.querySelector(".group-counts"), `${plural(history.length, "failure")}${kinds ? `: ${kinds}` : ""} · ${plural(inst.restarts, "restart")} · now ${inst.state}`);
        syncList(group.querySelector(".failure-list"), history, (f) => `${f.life}:${f.at}`, (f) => createFailure(inst.id, f));
      },
    );
    $("no-failures").hidden = groups.length > 0;
    const count = $("failure-count");
    count.hidden = total === 0;
    setText(count, String(total));
  }

  function renderCatalog(scheduler) {
    const models = Object.entries((scheduler && scheduler.models) || {}).map(([id, m]) => ({ id, ...m }));
    syncList(
      $("catalog-rows"),
      models,
      (m) => m.id,
      (m) =>
        el(
          "li",
          { class: "model", testid: "catalog-model", data: { model: m.id } },
          el(
            "div",
            { class: "model-line" },
            el("span", { class: "model-id", text: m.id, title: m.id }),
            el("span", { class: "badge model-state" }),
            el("span", { class: "spacer" }),
            el("button", { type: "button", class: "ghost small", testid: "catalog-load", text: "load", on: { click: () => loadModel(m.id) } }),
            el("button", { type: "button", class: "ghost small", testid: "catalog-unload", text: "unload", on: { click: () => unloadModel(m.id) } }),
          ),
          el("div", { class: "muted small model-src" }),
        ),
      (row, m) => {
        const badge = row.querySelector(".model-state");
        setText(badge, m.busy ? `${m.state}, busy` : m.state);
        badge.dataset.state = m.state;
        const mem = m.footprint !== null && m.footprint !== undefined ? `footprint ${bytes(m.footprint)}` : m.estimate ? `~${bytes(m.estimate)} estimated` : null;
        const expires = m.expires_in !== null && m.expires_in !== undefined ? `unloads in ${seconds(m.expires_in)}` : null;
        const facts = [m.engine, m.model ? m.model.split("/").pop() : null, mem, expires, m.pinned ? "pinned" : null];
        setText(row.querySelector(".model-src"), facts.filter(Boolean).join(" · "));
        row.querySelector('[data-testid="catalog-load"]').hidden = m.state !== "unloaded";
        row.querySelector('[data-testid="catalog-unload"]').hidden = m.state !== "loaded" || m.pinned;
      },
    );
  }

  function renderEvents(listId, events, line) {
    const last = events.slice(-10).reverse();
    syncList($(listId), last, (e) => `${e.at}:${e.kind}:${e.model || e.node}`, (e) =>
      el("li", {}, el("span", { class: "muted small", text: clock(e.at) }), " ", el("strong", { text: e.kind }), " ", line(e)),
    );
  }

  /** The numbers an operator looks for first, across every instance. */
  function renderGlance(data) {
    const instances = data.data || [];
    let running = 0;
    let waiting = 0;
    let tps = 0;
    let known = false;
    let restarts = 0;
    let failures = 0;
    let last = null;
    for (const inst of instances) {
      running += (inst.queue && inst.queue.running) || 0;
      waiting += (inst.queue && inst.queue.waiting) || 0;
      restarts += inst.restarts || 0;
      for (const n of Object.values(inst.failures || {})) failures += n;
      for (const f of inst.history || []) if (!last || f.at > last.at) last = { ...f, instance: inst.id };
      const s = series.get(inst.id);
      const sample = s && s.samples[s.samples.length - 1];
      if (sample && sample.tps !== null) {
        tps += sample.tps;
        known = true;
      }
    }
    const ready = instances.filter((i) => i.ready).length;
    const models = Object.values((data.scheduler && data.scheduler.models) || {});
    const loaded = models.filter((m) => m.state === "loaded").length;
    const memory = data.node && data.node.memory;
    const figures = [
      ["instances ready", `${ready} of ${instances.length}`, "glance-ready", ready < instances.length ? "warn" : "ok"],
      ["running", String(running), "glance-running"],
      ["waiting", String(waiting), "glance-waiting", waiting > 0 ? "warn" : null],
      ["tokens/s", known ? rate(tps) : "–", "glance-tps"],
      ["failures", String(failures), "glance-failures", failures > 0 ? "bad" : null],
      ["restarts", String(restarts), "glance-restarts"],
      ["models loaded", models.length ? `${loaded} of ${models.length}` : "–", "glance-models"],
      ["available", memory ? bytes(memory.available) : "–", "glance-available"],
    ];
    syncList(
      $("glance"),
      figures,
      (f) => f[2],
      (f) => el("div", { class: "glance-item" }, el("div", { class: "stat-label", text: f[0] }), el("div", { class: "glance-value", testid: f[2] })),
      (item, f) => {
        setText(item.lastChild, f[1]);
        item.dataset.level = f[3] || "";
      },
    );
    const lastLine = last ? `last failure ${clock(last.at)} on ${last.instance}: ${last.cause.summary}` : "no failures";
    $("glance").title = lastLine;
  }

  function render(data, nowMs) {
    const node = data.node;
    setText($("server"), node ? `tether ${node.version} · pid ${node.pid} · up ${uptime(node.uptime)}` : "");
    renderNodes(data);
    renderInstances(data.data || [], nowMs);
    renderFailures(data.data || []);
    renderCatalog(data.scheduler);
    renderGlance(data);
    renderEvents("decisions", (data.scheduler && data.scheduler.decisions) || [], (d) => `${d.model}: ${d.reason}`);
    const cluster = data.cluster;
    $("cluster-events-card").hidden = !cluster;
    if (cluster) renderEvents("cluster-events", cluster.events || [], (e) => `${e.node.slice(0, 8)}: ${e.why}`);
    // Engines the start form suggests: the installed ones we can see in use, beside the usual two.
    const engines = new Set(["llama.cpp", "debug"]);
    for (const inst of data.data || []) engines.add(inst.engine);
    for (const m of Object.values((data.scheduler && data.scheduler.models) || {})) engines.add(m.engine);
    syncList($("engines"), [...engines], (e) => e, (e) => el("option", { value: e }));
  }

  // ------------------------------------------------------------------------------------------------------------
  // Actions
  // ------------------------------------------------------------------------------------------------------------

  function lastInstance(id) {
    return lastData && (lastData.data || []).find((i) => i.id === id);
  }

  function stopInstance(id) {
    const inst = lastInstance(id);
    const pid = inst && inst.runner ? ` (runner pid ${inst.runner.pid})` : "";
    const flying = inst && inst.in_flight_requests ? inst.in_flight_requests.length : 0;
    return act({
      title: `Stop instance ${id}?`,
      body: `DELETE /v1/instances/${id}: its runner${pid} is stopped within its stop bound and the instance is removed.${flying ? ` ${plural(flying, "request")} in flight end with an error.` : ""}`,
      okLabel: "Stop",
      call: () => api("DELETE", `/v1/instances/${encodeURIComponent(id)}`),
      done: (a) => `${a.id}: deleted, now ${a.state}`,
    });
  }

  function cancelRequest(instanceId, requestId) {
    return act({
      title: `Cancel request ${requestId}?`,
      body: `POST /v1/requests/${requestId}/cancel: the generation on ${instanceId} stops at its next token and its client gets what was produced.`,
      okLabel: "Cancel request",
      call: () => api("POST", `/v1/requests/${encodeURIComponent(requestId)}/cancel`),
      done: (a) => `${a.outcome}: ${a.detail}`,
    });
  }

  function loadModel(id) {
    const started = performance.now();
    return act({
      title: `Load model ${id}?`,
      body: `POST /api/generate {"model": "${id}"} without a prompt: the scheduler loads it (evicting an idle model if it must) and answers once it is ready.`,
      okLabel: "Load",
      call: () => {
        toast("info", `Loading ${id}…`, "the answer comes when it is loaded");
        return api("POST", "/api/generate", { model: id });
      },
      done: (a) => `${a.model}: ${a.done_reason || "done"} in ${seconds((performance.now() - started) / 1000)}`,
    });
  }

  function unloadModel(id) {
    return act({
      title: `Unload model ${id}?`,
      body: `POST /api/generate {"model": "${id}", "keep_alive": 0}: its runner is stopped once it is idle; a later request loads it again.`,
      okLabel: "Unload",
      call: () => api("POST", "/api/generate", { model: id, keep_alive: 0 }),
      done: (a) => `${a.model}: ${a.done_reason || "done"}`,
    });
  }

  $("start-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const form = event.target;
    const error = $("start-error");
    error.hidden = true;
    const values = Object.fromEntries(new FormData(form).entries());
    let options;
    try {
      options = values.options.trim() ? JSON.parse(values.options) : {};
      if (typeof options !== "object" || options === null || Array.isArray(options)) throw new Error("options must be a JSON object");
    } catch (exc) {
      error.textContent = `options: ${exc.message}`;
      error.hidden = false;
      return;
    }
    const body = { engine: values.engine.trim() || "llama.cpp", options };
    if (values.id.trim()) body.id = values.id.trim();
    if (values.model.trim()) body.model = values.model.trim();
    const answer = await act({
      title: `Start instance ${body.id || "(named after its model)"}?`,
      body: `POST /v1/instances ${JSON.stringify(body)}`,
      okLabel: "Start",
      call: () => api("POST", "/v1/instances", body),
      done: (a) => `${a.id}: created, ${a.state}${a.fit ? ` — ${a.fit}` : ""}`,
    });
    if (answer) form.elements.id.value = "";
  });

  // ------------------------------------------------------------------------------------------------------------
  // Polling: one request at a time, never a reload
  // ------------------------------------------------------------------------------------------------------------

  let lastData = null;
  let lastOk = 0;
  let timer = null;
  let inFlight = false;
  let again = false;

  function setConnection(state, text) {
    const conn = document.querySelector('[data-testid="connection"]');
    conn.dataset.state = state;
    setText(conn.querySelector(".conn-text"), text);
  }

  async function poll() {
    timer = null;
    if (inFlight) {
      again = true;
      return;
    }
    inFlight = true;
    try {
      const data = await api("GET", "/v1/instances");
      const now = Date.now();
      lastData = data;
      lastOk = now;
      showApp();
      render(data, now);
      document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1); // tests wait on it
      document.getElementById("app").classList.remove("stale");
      setConnection("live", "live");
    } catch (exc) {
      if (exc.status !== 401) {
        const age = lastOk ? Date.now() - lastOk : null;
        const stale = age === null || age > STALE_MS;
        if (stale) document.getElementById("app").classList.add("stale");
        setConnection(stale ? "down" : "live", `${age === null ? "no answer yet" : `last answer ${seconds(age / 1000)} ago`}: ${exc.message}`);
      }
    } finally {
      inFlight = false;
      schedule(again ? 0 : document.hidden ? HIDDEN_POLL_MS : POLL_MS);
      again = false;
    }
  }

  function schedule(ms) {
    if (timer !== null) clearTimeout(timer);
    if (!$("login").hidden && !apiKey) {
      timer = null; // waiting for the key: nothing to ask until it is given
      return;
    }
    timer = setTimeout(poll, ms);
  }

  function pollNow() {
    schedule(0);
  }

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) pollNow();
  });

  poll();
})();
