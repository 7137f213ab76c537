// GPUlayer dashboard: refresh the page's live part and follow a job's logs,
// only while the tab is visible. Every text from the server is set with
// textContent (never parsed as HTML); a refreshed fragment is HTML the server
// rendered with every value escaped.
"use strict";

(function () {
  const visible = () => document.visibilityState === "visible";
  let timer = null;

  function pollEvery() {
    const live = document.getElementById("live");
    return live ? Number(live.dataset.poll || 5000) : 0;
  }

  async function refreshLive() {
    const live = document.getElementById("live");
    if (!live || live.dataset.final) return;
    const url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    const reply = await fetch(url, { credentials: "same-origin" });
    if (reply.status === 401 || reply.redirected) { window.location.reload(); return; }
    if (!reply.ok) return;
    const doc = new DOMParser().parseFromString(await reply.text(), "text/html");
    live.replaceChildren(...doc.body.childNodes);
    if (reply.headers.get("x-gpulayer-final")) {
      live.dataset.final = "1";
    }
  }

  // ---- logs ----

  const SGR = /\x1b\[([0-9;]*)m/g;

  // The line's text as spans: ANSI colour codes become classes, the rest text.
  function colour(text, rank) {
    const out = document.createDocumentFragment();
    if (rank !== null && rank !== undefined) out.append(`[rank ${rank}] `);
    let classes = [];
    let at = 0;
    const put = (piece) => {
      if (!piece) return;
      if (!classes.length) { out.append(piece); return; }
      const span = document.createElement("span");
      span.className = classes.join(" ");
      span.textContent = piece;
      out.append(span);
    };
    for (const m of text.matchAll(SGR)) {
      put(text.slice(at, m.index));
      at = m.index + m[0].length;
      for (const code of (m[1] || "0").split(";").map(Number)) {
        if (code === 0) classes = [];
        else if (code === 1) classes.push("ansi-bold");
        else if (code >= 30 && code <= 37) classes = classes.filter((c) => !/^ansi-3/.test(c)).concat(`ansi-${code}`);
        else if (code >= 90 && code <= 97) classes = classes.filter((c) => !/^ansi-3/.test(c)).concat(`ansi-${code - 60}`);
      }
    }
    put(text.slice(at));
    return out;
  }

  function lineElement(stream, text, rank) {
    const el = document.createElement("span");
    el.className = `line ${stream}`;
    if (rank !== null && rank !== undefined) el.dataset.rank = String(rank);
    el.append(colour(text, rank));
    return el;
  }

  function applyFilters(el) {
    const search = document.getElementById("log-search");
    const rank = document.getElementById("log-rank");
    const q = search ? search.value.toLowerCase() : "";
    const r = rank ? rank.value : "";
    const show = (!q || el.textContent.toLowerCase().includes(q)) && (!r || el.dataset.rank === r);
    el.classList.toggle("hidden", !show);
  }

  function noteRank(rank) {
    const select = document.getElementById("log-rank");
    if (!select || rank === null || rank === undefined) return;
    const value = String(rank);
    if ([...select.options].some((o) => o.value === value)) return;
    const option = document.createElement("option");
    option.value = value;
    option.textContent = `rank ${value}`;
    select.append(option);
  }

  function setUpLog(log) {
    // Lines the server rendered as text: colour them the same way.
    for (const el of [...log.querySelectorAll(".line")]) {
      const rank = el.dataset.rank === undefined ? null : Number(el.dataset.rank);
      const fresh = lineElement([...el.classList].find((c) => c !== "line") || "stdout", el.textContent, rank);
      noteRank(rank);
      el.replaceWith(fresh);
    }
    const refilter = () => log.querySelectorAll(".line").forEach(applyFilters);
    document.getElementById("log-search")?.addEventListener("input", refilter);
    document.getElementById("log-rank")?.addEventListener("change", refilter);
    if (document.getElementById("log-follow")?.checked) log.scrollTop = log.scrollHeight;
  }

  async function followLogs() {
    const log = document.getElementById("log");
    if (!log || log.dataset.done) return;
    const url = `/jobs/${encodeURIComponent(log.dataset.job)}/logs?attempt=${log.dataset.attempt}&seq=${log.dataset.seq}`;
    const reply = await fetch(url, { credentials: "same-origin" });
    if (reply.status === 401) { window.location.reload(); return; }
    if (!reply.ok) return;
    const chunk = await reply.json();
    for (const line of chunk.lines) {
      const el = lineElement(line.stream, line.text, line.rank);
      noteRank(line.rank);
      applyFilters(el);
      log.append(el);
    }
    log.dataset.attempt = String(chunk.attempt);
    log.dataset.seq = String(chunk.seq);
    if (chunk.done) log.dataset.done = "1";
    if (chunk.lines.length && document.getElementById("log-follow")?.checked) {
      log.scrollTop = log.scrollHeight;
    }
  }

  // ---- the loop: nothing is asked while the tab is hidden ----

  async function tick() {
    try {
      await refreshLive();
      await followLogs();
    } catch (err) {
      // The server restarting, say: try again at the next tick.
    } finally {
      schedule();
    }
  }

  function schedule() {
    window.clearTimeout(timer);
    timer = null;
    const every = pollEvery() || (document.getElementById("log") ? 2000 : 0);
    if (every && visible()) timer = window.setTimeout(tick, every);
  }

  document.addEventListener("visibilitychange", () => {
    if (visible()) tick(); else { window.clearTimeout(timer); timer = null; }
  });

  document.addEventListener("DOMContentLoaded", () => {
    const log = document.getElementById("log");
    if (log) setUpLog(log);
    schedule();
  });
})();
