// Sessions page: the workload table (tabs, filters, pages, live rows), the launch dialog and
// the terminate confirmation. Server-rendered first; this script keeps the page current and
// its place in the address (?tab=&status=&owner=&node=&page=). Needs console.js (window.fgpu).
(function () {
  "use strict";

  var ACTIVE = ["PENDING", "SCHEDULED", "PREPARING", "RUNNING"];
  var API_SESSIONS = "/api/v1/sessions/";
  var API_OPTIONS = "/api/v1/launch-options/";
  var API_IMAGES = "/api/v1/images/?limit=1000";
  var API_PRESETS = "/api/v1/presets/?limit=1000";
  var HOST_IMAGE = "host"; // the process runtime's built-in image: the default where none is marked

  var $ = function (id) { return document.getElementById(id); };
  var fgpu = window.fgpu;
  var api = fgpu.api, errorText = fgpu.errorText;
  var tbody = $("sessions-body");
  var emptyState = $("sessions-empty");
  var sessions = new Map(); // id -> session JSON, the rows shown
  var launchOptions = readJson("launch-options") || { slots: [] };
  var listState = readJson("list-state") || {};

  function readJson(id) {
    var el = $(id);
    if (!el) return null;
    try { return JSON.parse(el.textContent); } catch (e) { return null; }
  }

  // ---- Decimal strings (no floats for GPU amounts) ------------------------

  // "0.75" -> {n: 75n, scale: 2}
  function dec(s) {
    var str = String(s).trim();
    var m = str.match(/^(-?)(\d*)(?:\.(\d*))?$/);
    if (!m) return { n: 0n, scale: 0 };
    var frac = m[3] || "";
    var n = BigInt((m[2] || "0") + frac);
    return { n: m[1] ? -n : n, scale: frac.length };
  }

  function decCompare(a, b) {
    var x = dec(a), y = dec(b), s = Math.max(x.scale, y.scale);
    var xn = x.n * 10n ** BigInt(s - x.scale), yn = y.n * 10n ** BigInt(s - y.scale);
    return xn < yn ? -1 : xn > yn ? 1 : 0;
  }

  // Fixed-point with `digits` decimals, truncating (as the slot format's round_length).
  function formatAmount(value, digits) {
    var str = String(value).trim();
    var neg = str[0] === "-";
    if (neg) str = str.slice(1);
    var parts = str.split(".");
    var intPart = parts[0] || "0";
    if (!digits) return (neg ? "-" : "") + intPart;
    var frac = ((parts[1] || "") + "0".repeat(digits)).slice(0, digits);
    return (neg ? "-" : "") + intPart + "." + frac;
  }

  // amount (decimal string) * integer -> decimal string with up to 2 decimals, trimmed.
  function mulTrim(amount, integer) {
    var a = dec(amount);
    var scaled = a.n * BigInt(integer) * 100n / 10n ** BigInt(a.scale); // truncates
    var whole = scaled / 100n, cents = scaled % 100n;
    var out = whole.toString();
    if (cents) out += "." + cents.toString().padStart(2, "0").replace(/0+$/, "");
    return out;
  }

  var BIN_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  function formatBytes(bytes) {
    var b = BigInt(bytes), i = 0, div = 1n;
    while (i < BIN_UNITS.length - 1 && b >= div * 1024n) { div *= 1024n; i++; }
    var hundredths = b * 100n / div;
    var whole = hundredths / 100n, cents = hundredths % 100n;
    var out = whole.toString();
    if (cents) out += "." + cents.toString().padStart(2, "0").replace(/0+$/, "");
    return out + " " + BIN_UNITS[i];
  }

  function bytesOf(amount, unitBytes) {
    var a = dec(amount);
    return (a.n * BigInt(unitBytes)) / 10n ** BigInt(a.scale);
  }

  // ---- Table rows --------------------------------------------------------

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (attrs[k] === null || attrs[k] === undefined || attrs[k] === false) return;
      if (k === "text") node.textContent = attrs[k];
      else node.setAttribute(k, attrs[k]);
    });
    (children || []).forEach(function (c) {
      if (c) node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return node;
  }

  // The reason under the status: why it waits, or how it ended in words ("terminated by you").
  function reasonOf(s) {
    if (fgpu.FINAL.indexOf(s.status) !== -1 || s.status === "TERMINATING") return fgpu.endReason(s) || null;
    if (!s.status_reason) return null;
    // A reason that only repeats the status says nothing.
    return String(s.status_reason).toLowerCase() === String(s.status).toLowerCase() ? null : s.status_reason;
  }

  var REASON_SHORT = 90; // characters: a longer reason shows two lines and a "Show all" toggle

  var timeFormat = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "short" });
  var relFormat = new Intl.RelativeTimeFormat(undefined, { numeric: "auto" });

  function relative(date) {
    var secs = Math.round((date.getTime() - Date.now()) / 1000);
    var abs = Math.abs(secs);
    if (abs < 45) return "just now";
    if (abs < 3600) return relFormat.format(Math.round(secs / 60), "minute");
    if (abs < 86400) return relFormat.format(Math.round(secs / 3600), "hour");
    return timeFormat.format(date);
  }

  function renderTimes(root) {
    (root || document).querySelectorAll("time[datetime]").forEach(function (t) {
      var d = new Date(t.getAttribute("datetime"));
      if (isNaN(d)) return;
      t.textContent = relative(d);
      t.title = timeFormat.format(d);
    });
  }

  // An end the user did not ask for, coming (issue 36.3): preemption (`preempt_at`), else idle
  // reclamation or the maximum lifetime (`deadline`, `deadline_reason`): {kind, at, words} or null.
  function noticeOf(s) {
    if (s.status !== "RUNNING") return null;
    if (s.preempt_at) return { kind: "preempt", at: s.preempt_at, words: "preempted", why: s.status_reason || "" };
    if (!s.deadline) return null;
    var lifetime = /^reached its maximum lifetime/.test(s.deadline_reason || "");
    return { kind: lifetime ? "lifetime" : "idle", at: s.deadline, words: lifetime ? "lifetime ends" : "idle: ends",
             why: s.deadline_reason || "" };
  }

  function two(n) { return (n < 10 ? "0" : "") + n; }
  function countdown(iso, now) { // "4:05", "1:02:03", "now"
    var left = Math.ceil((Date.parse(iso) - now) / 1000);
    if (!(left > 0)) return "now";
    var h = Math.floor(left / 3600), m = Math.floor((left % 3600) / 60);
    return (h ? h + ":" + two(m) : String(m)) + ":" + two(left % 60);
  }

  function renderNotice(badge, now) {
    var left = countdown(badge.getAttribute("data-ends"), now);
    // drawn from data-text (CSS), so that td.status's text stays the status alone
    badge.setAttribute("data-text", badge.getAttribute("data-words") + (left === "now" ? " now" : " in " + left));
  }

  // Elapsed time of every row, live ones each second (and their notices' countdowns).
  function renderElapsed(onlyLive) {
    var now = Date.now();
    tbody.querySelectorAll(".notice-badge").forEach(function (badge) { renderNotice(badge, now); });
    tbody.querySelectorAll("tr[data-session-id]").forEach(function (row) {
      var s = sessions.get(row.getAttribute("data-session-id"));
      var cell = row.querySelector(".elapsed-text");
      if (!s || !cell || (onlyLive && row.getAttribute("data-live") !== "true")) return;
      var e = fgpu.elapsed(s, now);
      cell.textContent = e.text;
      row.setAttribute("data-live", e.live ? "true" : "false");
    });
  }

  function showOwner() { return listState.show_owner === true; }

  function renderRow(s) {
    var reason = reasonOf(s);
    var nodeCell = el("td", { "class": "node", "data-label": "Node" });
    if (s.node) {
      nodeCell.appendChild(el("span", { "class": "node-name", text: s.node }));
      if (s.allocations && s.allocations.length) {
        nodeCell.appendChild(el("span", {
          "class": "sub",
          text: s.allocations.map(function (a) { return "GPU " + a.device_index; }).join(", "),
        }));
      }
      if (s.status === "RUNNING" && s.allocations && s.allocations.length) nodeCell.appendChild(usageGauge(s));
    } else {
      nodeCell.appendChild(el("span", { "class": "muted", text: "—" }));
    }

    var actions = el("div", { "class": "row-actions" });
    if (s.status === "RUNNING") {
      actions.appendChild(el("a", { "class": "button button-small terminal-link", href: s.terminal_url, text: "Terminal" }));
      (s.apps || []).forEach(function (app) {  // the image's web apps: each starts, then opens, in a new tab
        actions.appendChild(el("a", { "class": "button button-small app-link", href: app.url, target: "_blank",
          rel: "noopener", "data-app": app.name, title: "Open " + app.title + " in a new tab", text: app.title }));
      });
    } else {
      actions.appendChild(el("span", {
        "class": "button button-small terminal-link-disabled", "aria-disabled": "true",
        title: "The terminal opens once the session is RUNNING", text: "Terminal",
      }));
    }
    if (ACTIVE.indexOf(s.status) !== -1) {
      actions.appendChild(el("button", {
        type: "button", "class": "button button-small button-danger-ghost terminate-button",
        "data-session-id": s.id, text: "Terminate",
      }));
    }

    // td.status's text is the status alone; the reason is drawn from data-reason (CSS), cut to
    // two lines when long, with a toggle (labelled by CSS too) that shows the whole of it.
    var long = reason && reason.length > REASON_SHORT;
    var statusCell = el("td", { "class": "status", "data-label": "Status", "data-reason": reason, title: reason,
                                "data-long": long ? "true" : null }, [
      el("span", { "class": "badge status-" + String(s.status).toLowerCase(), text: s.status }),
    ]);
    var notice = noticeOf(s);
    if (notice) {
      var badge = el("span", { "class": "notice-badge", "data-kind": notice.kind, "data-ends": notice.at,
                               "data-words": notice.words, title: notice.why + " (at " + timeFormat.format(new Date(notice.at)) + ")" });
      renderNotice(badge, Date.now());
      statusCell.appendChild(badge);
    }
    if (long) {
      statusCell.appendChild(el("button", { type: "button", "class": "reason-toggle", "aria-expanded": "false",
                                            "aria-label": "Show all of the reason" }));
    }

    var elapsed = fgpu.elapsed(s);
    return el("tr", { "data-session-id": s.id, "data-status": s.status, "data-live": elapsed.live ? "true" : "false" }, [
      el("td", { "class": "name", "data-label": "Name" }, [el("span", { "class": "session-name", text: s.name })]),
      showOwner() ? el("td", { "class": "owner", "data-label": "Owner", text: s.owner }) : null,
      statusCell,
      configurationCell(s),
      nodeCell,
      el("td", { "class": "elapsed", "data-label": "Elapsed" }, [
        el("span", { "class": "elapsed-text", text: elapsed.text }),
        el("span", { "class": "sub" }, ["created ", el("time", { datetime: s.created_at, text: s.created_at })]),
      ]),
      el("td", { "class": "actions", "data-label": "" }, [actions]),
    ]);
  }

  // GPU memory used of granted, live: an empty gauge that usage.js fills from /api/v1/usage/latest/
  // (data-limit: bytes granted by the held allocations, shown until the first answer).
  function usageGauge(s) {
    var limit = (s.allocations || []).reduce(function (sum, a) { return a.released_at ? sum : sum + Number(a.memory); }, 0);
    return el("span", { "class": "usage-gauge", "data-session-id": s.id, "data-limit": String(limit), "data-state": "waiting" }, [
      el("span", { "class": "usage-gauge-bar", "aria-hidden": "true" }, [el("span", { "class": "usage-gauge-fill" })]),
      el("span", { "class": "usage-gauge-text", text: "— / " + formatBytes(limit) }),
    ]);
  }

  // What the session asked for; for MIG and isolation "any" also what it got and why.
  function configurationCell(s) {
    var cell = el("td", { "class": "configuration", "data-label": "Configuration" });
    if (!s.grant) { cell.appendChild(configText(s.configuration, "config-text")); return cell; }
    cell.appendChild(configText(s.requested, "config-requested"));
    if (s.mig_profile) {
      cell.appendChild(el("span", {
        "class": "mig-chip", text: "MIG " + s.mig_profile,
        title: "A MIG instance: its own memory and compute slices, isolated in hardware",
      }));
    }
    cell.appendChild(el("span", { "class": "sub config-grant", text: s.grant }));
    return cell;
  }

  // "0.50 fGPU · 1 core · 1 GiB", wrapping between its parts only.
  function configText(text, className) {
    var span = el("span", { "class": className });
    String(text || "").split(" · ").forEach(function (part, i) {
      if (i) span.appendChild(document.createTextNode(" · "));
      span.appendChild(el("span", { "class": "config-part", text: part }));
    });
    return span;
  }

  tbody.addEventListener("click", function (ev) {
    var toggle = ev.target.closest(".reason-toggle");
    if (!toggle) return;
    var open = toggle.getAttribute("aria-expanded") !== "true";
    toggle.setAttribute("aria-expanded", open ? "true" : "false");
    toggle.setAttribute("aria-label", open ? "Show less of the reason" : "Show all of the reason");
  });

  function findRow(id) {
    return tbody.querySelector('tr[data-session-id="' + CSS.escape(id) + '"]');
  }

  // A session the server sent (a notice, an answer): its row is redrawn in place. One not shown
  // yet joins the first page when the tab and filters would show it.
  function upsert(s, highlight) {
    if (!s || !s.id) return;
    // Never let an older state (a slow POST answer, the web's notice after the manager's) undo a newer one.
    if (fgpu.isStale(s, sessions.get(s.id))) return;
    var existing = findRow(s.id);
    if (!existing && (filters.page !== 1 || !matches(s))) return;
    sessions.set(s.id, s);
    var row = renderRow(s);
    if (existing) {
      var changed = existing.getAttribute("data-status") !== s.status;
      var toggle = existing.querySelector(".reason-toggle[aria-expanded=true]");
      existing.replaceWith(row);
      if (toggle && row.querySelector(".reason-toggle")) row.querySelector(".reason-toggle").click();
      if (changed) flash(row);
    } else {
      tbody.insertBefore(row, tbody.firstChild);
      total += 1;
      while (tbody.rows.length > pageSize) dropRow(tbody.rows[tbody.rows.length - 1]);
      if (highlight !== false) flash(row);
      renderRange();
    }
    renderTimes(row);
    updateEmpty();
  }

  function dropRow(row) {
    sessions.delete(row.getAttribute("data-session-id"));
    row.remove();
  }


  function flash(row) {
    row.classList.add("row-flash");
    setTimeout(function () { row.classList.remove("row-flash"); }, 1600);
  }

  var EMPTY = {
    all: ["No sessions yet", "Start a session to get a slice of a GPU and a terminal on it."],
    running: ["No running sessions", "Sessions waiting, starting or running show here."],
    finished: ["No finished sessions", "Sessions that ended, failed or were cancelled show here."],
  };

  function updateEmpty() {
    var empty = tbody.rows.length === 0;
    emptyState.hidden = !empty;
    $("sessions-table").classList.toggle("is-empty", empty);
    var filtered = filters.status || filters.owner || filters.node;
    var words = filtered ? ["No sessions match these filters", "Clear the filters to see more."] : EMPTY[filters.tab];
    $("empty-title").textContent = words[0];
    $("empty-text").textContent = words[1];
  }

  // The page's rows as the server holds them now (the list is authoritative).
  function replaceAll(list) {
    var open = new Set();
    tbody.querySelectorAll(".reason-toggle[aria-expanded=true]").forEach(function (t) {
      open.add(t.closest("tr").getAttribute("data-session-id"));
    });
    sessions.clear();
    tbody.textContent = "";
    list.forEach(function (s) {
      sessions.set(s.id, s);
      var row = renderRow(s);
      tbody.appendChild(row);
      if (open.has(s.id) && row.querySelector(".reason-toggle")) row.querySelector(".reason-toggle").click();
    });
    renderTimes(tbody);
    updateEmpty();
  }

  var notice = $("page-notice");
  var noticeTimer = null;
  function showNotice(text, kind) {
    notice.textContent = text;
    notice.className = "alert alert-" + (kind || "info");
    notice.hidden = false;
    clearTimeout(noticeTimer);
    noticeTimer = setTimeout(function () { notice.hidden = true; }, 8000);
  }

  // ---- The list's place: tab, filters, page (in the address too) -----------------------

  var FINAL = fgpu.FINAL;
  var ORDER = ["PENDING", "SCHEDULED", "PREPARING", "RUNNING", "TERMINATING", "TERMINATED", "ERROR", "CANCELLED"];
  var TABS = {
    all: ORDER,
    running: ["PENDING", "SCHEDULED", "PREPARING", "RUNNING", "TERMINATING"],
    finished: FINAL,
  };
  var pageSize = listState.page_size || 25;
  var total = listState.count || 0;
  var filters = normalised(listState.filters || {});
  var statusSelect = $("filter-status"), ownerSelect = $("filter-owner"), nodeSelect = $("filter-node");

  function normalised(f) {
    var tab = TABS[f.tab] ? f.tab : "all";
    var page = parseInt(f.page, 10);
    return {
      tab: tab,
      status: TABS[tab].indexOf(String(f.status || "").toUpperCase()) !== -1 ? String(f.status).toUpperCase() : "",
      owner: showOwner() ? String(f.owner || "") : "",
      node: String(f.node || ""),
      page: page > 0 ? page : 1,
    };
  }

  function fromAddress() {
    var q = new URLSearchParams(location.search);
    return normalised({ tab: q.get("tab"), status: q.get("status"), owner: q.get("owner"), node: q.get("node"),
                        page: q.get("page") });
  }

  // ?tab=… for the page's address; the defaults are left out.
  function pageQuery(f) {
    var q = new URLSearchParams();
    if (f.tab !== "all") q.set("tab", f.tab);
    ["status", "owner", "node"].forEach(function (k) { if (f[k]) q.set(k, f[k]); });
    if (f.page > 1) q.set("page", String(f.page));
    var text = q.toString();
    return text ? "?" + text : location.pathname;
  }

  // The same place as GET /api/v1/sessions/ parameters.
  function apiQuery(f) {
    var q = new URLSearchParams();
    if (f.status) q.set("status", f.status);
    else if (f.tab !== "all") q.set("status", TABS[f.tab].join(","));
    if (f.owner) q.set("owner", f.owner);
    if (f.node) q.set("node", f.node);
    q.set("limit", String(pageSize));
    q.set("offset", String((f.page - 1) * pageSize));
    return API_SESSIONS + "?" + q.toString();
  }

  function matches(s) {
    var statuses = filters.status ? [filters.status] : TABS[filters.tab];
    return statuses.indexOf(s.status) !== -1 && (!filters.owner || s.owner === filters.owner) &&
      (!filters.node || s.node === filters.node);
  }

  function fillSelect(select, values, chosen, label) {
    if (!select) return;
    var first = select.options[0];
    select.textContent = "";
    select.appendChild(first);
    var list = values.slice();
    if (chosen && list.indexOf(chosen) === -1) list.push(chosen); // a name from the address, kept visible
    list.forEach(function (v) { select.appendChild(el("option", { value: v, text: label ? label(v) : v })); });
    select.value = chosen || "";
  }

  function renderFilters() {
    document.querySelectorAll(".list-tab").forEach(function (a) {
      var tab = a.getAttribute("data-tab");
      if (tab === filters.tab) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
      a.href = pageQuery({ tab: tab, status: "", owner: filters.owner, node: filters.node, page: 1 });
    });
    fillSelect(statusSelect, TABS[filters.tab], filters.status, function (v) { return v.charAt(0) + v.slice(1).toLowerCase(); });
    fillSelect(ownerSelect, listState.owners || [], filters.owner);
    fillSelect(nodeSelect, listState.nodes || [], filters.node);
    $("filters-clear").hidden = !(filters.status || filters.owner || filters.node);
    renderRange();
  }

  function renderRange() {
    var first = total ? (filters.page - 1) * pageSize + 1 : 0;
    var last = Math.min(total, (filters.page - 1) * pageSize + tbody.rows.length);
    $("list-range").textContent = total ? first + "–" + last + " of " + total : "0 sessions";
    setPageLink($("page-prev"), filters.page > 1, filters.page - 1);
    setPageLink($("page-next"), filters.page * pageSize < total, filters.page + 1);
    $("pager").hidden = total === 0;
    document.querySelector(".pager-buttons").hidden = total <= pageSize && filters.page === 1;
  }

  function setPageLink(link, enabled, page) {
    link.href = pageQuery(Object.assign({}, filters, { page: Math.max(1, page) }));
    if (enabled) link.removeAttribute("aria-disabled");
    else link.setAttribute("aria-disabled", "true");
  }

  var loadSeq = 0;
  // Show `next` (a place): ask the server for its page, then draw it. `push`: a new history entry.
  function go(next, push) {
    filters = normalised(next);
    renderFilters();
    updateEmpty();
    if (push) history.pushState(null, "", pageQuery(filters));
    else history.replaceState(null, "", pageQuery(filters));
    return load();
  }

  function load() {
    var seq = ++loadSeq;
    $("sessions-table").setAttribute("aria-busy", "true");
    return api("GET", apiQuery(filters)).then(function (r) {
      if (seq !== loadSeq) return;
      $("sessions-table").removeAttribute("aria-busy");
      if (!r.ok || !r.data || !Array.isArray(r.data.results)) {
        if (!r.signedOut) showNotice("Could not load the sessions: " + errorText(r), "error");
        return;
      }
      total = r.data.count;
      if (!r.data.results.length && filters.page > 1 && total) { // past the last page: the last
        filters.page = Math.ceil(total / pageSize);
        return go(filters, false);
      }
      replaceAll(r.data.results);
      renderRange();
    }).catch(function () {
      if (seq === loadSeq) $("sessions-table").removeAttribute("aria-busy");
      /* the websocket's reconnect loads it again */
    });
  }

  document.querySelector(".list-tabs").addEventListener("click", function (ev) {
    var a = ev.target.closest(".list-tab");
    if (!a || ev.metaKey || ev.ctrlKey || ev.shiftKey || ev.button !== 0) return;
    ev.preventDefault();
    go({ tab: a.getAttribute("data-tab"), owner: filters.owner, node: filters.node, page: 1 }, true);
  });
  $("list-filters").addEventListener("change", function () {
    go({ tab: filters.tab, status: statusSelect.value, owner: ownerSelect ? ownerSelect.value : "",
         node: nodeSelect.value, page: 1 }, true);
  });
  $("list-filters").addEventListener("submit", function (ev) { ev.preventDefault(); });
  $("filters-clear").addEventListener("click", function () {
    go({ tab: filters.tab, page: 1 }, true);
    $("filter-status").focus();
  });
  ["page-prev", "page-next"].forEach(function (id) {
    $(id).addEventListener("click", function (ev) {
      ev.preventDefault();
      if ($(id).getAttribute("aria-disabled") === "true") return;
      go(Object.assign({}, filters, { page: filters.page + (id === "page-next" ? 1 : -1) }), true)
        .then(function () { $("sessions-table").scrollIntoView({ block: "start" }); });
    });
  });
  window.addEventListener("popstate", function () { go(fromAddress(), false); });

  // ---- Live updates over /ws/sessions/ -----------------------------------

  var indicator = $("live-indicator");
  function setLive(state, text) {
    indicator.setAttribute("data-state", state);
    indicator.querySelector(".live-text").textContent = text;
  }

  // ---- Terminate ---------------------------------------------------------

  var terminateDialog = $("terminate-dialog");
  var terminateId = null;

  tbody.addEventListener("click", function (ev) {
    var btn = ev.target.closest(".terminate-button");
    if (!btn) return;
    terminateId = btn.getAttribute("data-session-id");
    var s = sessions.get(terminateId);
    $("terminate-name").textContent = s ? s.name : terminateId;
    terminateDialog.returnValue = "";
    terminateDialog.showModal();
    $("terminate-cancel").focus();
  });

  terminateDialog.addEventListener("close", function () {
    if (terminateDialog.returnValue !== "confirm" || !terminateId) return;
    var id = terminateId;
    terminateId = null;
    var row = findRow(id);
    var btn = row && row.querySelector(".terminate-button");
    if (btn) { btn.disabled = true; btn.textContent = "Terminating…"; }
    api("DELETE", API_SESSIONS + encodeURIComponent(id) + "/").then(function (r) {
      if (r.ok && r.data) { upsert(r.data); return; }
      if (btn) { btn.disabled = false; btn.textContent = "Terminate"; }
      showNotice("Could not terminate the session: " + errorText(r), "error");
    }).catch(function () {
      if (btn) { btn.disabled = false; btn.textContent = "Terminate"; }
      showNotice("Could not reach the server to terminate the session.", "error");
    });
  });

  // ---- Launch dialog -----------------------------------------------------

  var dialog = $("launch-dialog");
  var form = $("launch-form");
  var errorBox = $("launch-error");
  var slider = $("fgpu-slider");
  var readout = $("fgpu-readout");
  var gpuCount = $("gpu-count");
  var slotSelect = $("slot-select");
  var submit = $("launch-submit");
  var CPU_ONLY = "";
  var tabs = Array.prototype.slice.call(document.querySelectorAll('#style-tabs [role="tab"]'));
  var wantedStyle = null; // the tab the user picked last; kept while it is offered
  var slotBusy = false;
  var slotImpossible = false; // no node could ever hold the slot's smallest amount (e.g. every GPU is MIG)
  var wantedProfile = null; // the MIG profile the user picked last; kept while it can be had
  var launching = false;

  function currentSlot() {
    var slots = launchOptions.slots || [];
    if (!slots.length || slotSelect.value === CPU_ONLY) return null;
    for (var i = 0; i < slots.length; i++) if (slots[i].slot === slotSelect.value) return slots[i];
    return slots[0];
  }

  function slotLabel(slot) {
    var name = slot.human_readable_name || slot.slot;
    return name + " (" + slot.slot + ")";
  }

  function unitText(slot, amount) {
    // "1 GPU" / "2 GPUs" for a discrete slot whose unit is GPU, else "<amount> <unit>".
    return formatAmount(amount, slot.round_length || 0) + " " + (slot.display_unit || "");
  }

  function applyOptions(opts) {
    launchOptions = opts || { slots: [] };
    var slots = launchOptions.slots || [];
    var previous = slotSelect.value;
    slotSelect.textContent = "";
    slots.forEach(function (slot) {
      slotSelect.appendChild(el("option", { value: slot.slot, text: slotLabel(slot) }));
    });
    slotSelect.appendChild(el("option", { value: CPU_ONLY, text: "None (CPU only)" }));
    var keep = slots.some(function (s) { return s.slot === previous; }) || (previous === CPU_ONLY && slotSelect.dataset.touched);
    slotSelect.value = keep ? previous : (slots.length ? slots[0].slot : CPU_ONLY);

    $("no-gpu-note").hidden = slots.length > 0;
    $("slot-field").hidden = slots.length === 0;
    renderSlot();

    var cpu = launchOptions.cpu, mem = launchOptions.mem;
    var cpuInput = $("cpu-count");
    if (cpu) {
      if (cpu.max_ever) cpuInput.max = cpu.max_ever;
      $("cpu-capacity").textContent = cpu.max_now + " free now · " + cpu.max_ever + " on the largest node";
    }
    if (mem && mem.max_ever !== undefined) {
      $("mem-capacity").textContent = "e.g. 512M, 1G · " + formatBytes(mem.max_now) + " free now";
    }
  }

  function renderSlot() {
    var slot = currentSlot();
    var frac = $("fractional-controls"), disc = $("discrete-controls"), note = $("capacity-note");
    frac.hidden = true; disc.hidden = true; slotBusy = false; slotImpossible = false;
    slider.disabled = true; gpuCount.disabled = true;
    if (slot) renderSlotControls(slot, frac, disc, note);
    renderTabs();
  }

  function renderSlotControls(slot, frac, disc, note) {
    var busy = decCompare(slot.max_now, slot.min) < 0;
    // The slider reaches the largest amount any node could hold (more than is free now waits in
    // the queue), but not past what the user's quotas allow (launch-options' quota_max).
    var quotaCaps = slot.quota_max != null && decCompare(slot.quota_max, slot.min) >= 0 &&
      decCompare(slot.quota_max, slot.max_ever) < 0;
    var max = quotaCaps ? slot.quota_max : slot.max_ever;
    var impossible = decCompare(slot.max_ever, slot.min) < 0;
    slotBusy = busy;
    slotImpossible = impossible;
    note.textContent = impossible
      ? "No node can hold even " + unitText(slot, slot.min) + " of this slot right now."
      : "No capacity free now: the session will wait in the queue.";

    if (slot.allocation_mode === "discrete") {
      disc.hidden = false;
      gpuCount.disabled = false;
      gpuCount.min = "0";
      gpuCount.max = String(max);
      gpuCount.step = slot.step || "1";
      if (gpuCount.value === "" || decCompare(gpuCount.value, max) > 0) gpuCount.value = impossible ? "0" : String(slot.min);
      $("gpu-capacity").textContent = capacityText(slot, function (a) { return formatAmount(a, 0); });
      return;
    }

    frac.hidden = false;
    $("fgpu-label").textContent = slot.human_readable_name || slot.display_unit || "Amount";
    slider.min = slot.min;
    slider.step = slot.step || slot.quantum || slot.min;
    slider.max = impossible ? slot.min : max;
    slider.disabled = impossible;
    var wanted = slider.dataset.wanted || (decCompare(slot.min, "0.5") <= 0 && decCompare(max, "0.5") >= 0 ? "0.5" : slot.min);
    slider.value = decCompare(wanted, max) > 0 ? max : wanted;
    $("fgpu-scale-min").textContent = unitText(slot, slot.min);
    $("fgpu-scale-max").textContent = unitText(slot, slider.max);
    $("fgpu-capacity").textContent = capacityText(slot, function (a) { return unitText(slot, a); });
    updateReadout();
  }

  var QUOTA_LIMITS = { sessions: "no session left", fgpu: "no fGPU left", gpu_memory: "no GPU memory left",
                       devices: "no device left" };

  // "up to 0.75 fGPU free now · 3.25 fGPU on the largest node · capped by your quota: 1.00 fGPU"
  function capacityText(slot, fmt) {
    var text = "up to " + fmt(slot.free_now || slot.max_now) + " free now · " + fmt(slot.max_ever) + " on the largest node";
    if (slot.quota_max == null) return text;
    if (decCompare(slot.quota_max, slot.min) >= 0) return text + " · capped by your quota: " + fmt(slot.quota_max);
    return text + " · your quota allows none now (" + (QUOTA_LIMITS[slot.quota_limit] || "used up") + ")";
  }

  function updateReadout() {
    var slot = currentSlot();
    if (!slot || slot.allocation_mode === "discrete") return;
    var value = slider.value;
    readout.textContent = unitText(slot, value);
    var pct = 0;
    var lo = dec(slider.min), hi = dec(slider.max), cur = dec(value);
    var s = Math.max(lo.scale, hi.scale, cur.scale);
    var norm = function (d) { return Number(d.n * 10n ** BigInt(s - d.scale)); };
    if (norm(hi) > norm(lo)) pct = (norm(cur) - norm(lo)) / (norm(hi) - norm(lo)) * 100;
    slider.style.setProperty("--fill", pct + "%");
    var parts = [];
    if (slot.unit_mem) parts.push(formatBytes(bytesOf(value, slot.unit_mem)) + " GPU memory");
    if (slot.unit_proc) parts.push(mulTrim(value, slot.unit_proc) + " SMs");
    $("fgpu-meaning").textContent = parts.length ? "= " + parts.join(", ") + " per the fractional settings" : "";
    // More than is free now: a clear "will wait in the queue" (the preview says for what).
    var freeNow = slot.free_now || slot.max_now;
    slotBusy = decCompare(value, freeNow) > 0;
    $("capacity-note").textContent = decCompare(freeNow, slot.min) < 0
      ? "No capacity free now: the session will wait in the queue."
      : "More than the " + unitText(slot, freeNow) + " free now: the session will wait in the queue until it fits.";
    $("capacity-note").hidden = !(slotBusy && activeStyle() === "fgpu");
  }

  slider.addEventListener("input", function () {
    slider.dataset.wanted = slider.value;
    updateReadout();
  });
  slotSelect.addEventListener("change", function () {
    slotSelect.dataset.touched = "1";
    delete slider.dataset.wanted;
    renderSlot();
  });

  // ---- Request style tabs (WAI-ARIA tabs, automatic activation) ----------

  // fGPU for a fractional slot, whole GPUs for a discrete one; memory + cores and fraction for either.
  // ... and MIG where a node with MIG is in reach for the slot.
  function offeredStyles() {
    var slot = currentSlot();
    if (!slot) return [];
    var styles = [slot.allocation_mode === "discrete" ? "devices" : "fgpu", "memory", "fraction"];
    if (migProfiles().length) styles.push("mig");
    return styles;
  }

  function migOptions() {
    var slot = currentSlot(), mig = launchOptions.mig;
    return slot && mig && mig.slot_name === slot.slot_name ? mig : null;
  }

  function migProfiles() {
    var mig = migOptions();
    return mig && Array.isArray(mig.profiles) ? mig.profiles : [];
  }

  function activeStyle() {
    if ($("style-tabs").hidden) return null;
    for (var i = 0; i < tabs.length; i++) if (tabs[i].getAttribute("aria-selected") === "true") return tabs[i].dataset.style;
    return null;
  }

  // Every request style has its tab, so none looks missing; one this cluster cannot serve for the
  // slot says why (and how an administrator would offer it) instead of its fields.
  var UNAVAILABLE = {
    fgpu: "This slot hands out whole GPUs only: ask in the Whole GPUs tab. An administrator makes a slot " +
          "fractional (admin → Fractional settings).",
    devices: "GPUs of this slot are shared in fractions here: ask for whole GPUs in the fGPU tab (its slider " +
             "reaches whole GPUs). An administrator makes a slot hand out whole devices (admin → Fractional settings).",
    mig: "No GPU in reach serves MIG instances. An administrator turns MIG on for a node with MIG-capable GPUs " +
         "(admin → Nodes → MIG mode).",
  };

  function styleOffered(style) { return offeredStyles().indexOf(style) !== -1; }

  function renderTabs() {
    var styles = offeredStyles();
    $("style-tabs").hidden = styles.length === 0;
    tabs.forEach(function (t) {
      var offered = styles.indexOf(t.dataset.style) !== -1;
      t.hidden = false;
      t.classList.toggle("tab-unavailable", !offered);
      t.title = offered ? "" : UNAVAILABLE[t.dataset.style] || "";
    });
    renderMig();
    renderIsolationChoice();
    // Where the slot's own style can never be had (every GPU in reach is MIG), open on MIG.
    var first = slotImpossible && styles.indexOf("mig") !== -1 ? "mig" : styles[0];
    selectTab(styles.indexOf(wantedStyle) !== -1 ? wantedStyle : first, false);
  }

  // ---- MIG: the profiles in reach, each with its memory and how many are free now --------

  function migAvailability(p) {
    if (!p.max_ever) return { state: "never", text: "never fits" };
    if (!p.max_now) return { state: "wait", text: "none free now — will wait" };
    var idle = p.idle_now ? " · " + p.idle_now + " idle" : "";
    return { state: "free", text: p.max_now + " free now" + idle };
  }

  function migSlices(p) {
    var parts = [];
    if (p.compute_slices) parts.push(p.compute_slices + "/7 compute");
    if (p.sm_count) parts.push(p.sm_count + "\u00a0SMs");
    return parts.join(" · ");
  }

  function renderMig() {
    var box = $("mig-profiles"), profiles = migProfiles();
    box.textContent = "";
    if (!profiles.length) return;
    var usable = function (p) { return p.max_ever > 0; };
    var chosen = profiles.filter(function (p) { return p.name === wantedProfile && usable(p); })[0] ||
      profiles.filter(function (p) { return p.max_now > 0; })[0] || profiles.filter(usable)[0];
    profiles.forEach(function (p) {
      var avail = migAvailability(p);
      var id = "mig-profile-" + p.name.replace(/[^a-z0-9]+/gi, "-");
      var input = el("input", { type: "radio", name: "mig-profile", id: id, value: p.name,
                                disabled: avail.state === "never" ? "disabled" : null,
                                "aria-describedby": id + "-avail" });
      input.checked = chosen === p;
      var where = (p.models || []).length ? "On " + p.models.join(", ") : "";
      if (p.memory_slices) where += (where ? " · " : "") + p.memory_slices + " of 8 memory slices";
      box.appendChild(el("label", {
        "class": "mig-profile", "for": id, "data-state": avail.state, title: where || null,
      }, [
        input,
        el("span", { "class": "mig-name", text: p.name }),
        el("span", { "class": "mig-memory", text: p.memory_text || formatBytes(p.memory) }),
        el("span", { "class": "mig-slices", text: migSlices(p) }),
        el("span", { "class": "mig-avail", id: id + "-avail", text: avail.text }),
      ]));
    });
  }

  function chosenProfile() {
    var checked = document.querySelector('#mig-profiles input[name="mig-profile"]:checked');
    return checked ? checked.value : "";
  }

  $("mig-profiles").addEventListener("change", function () { wantedProfile = chosenProfile(); });

  // ---- Isolation of a memory-sized request: a shared slice, a MIG instance, or either ------

  var ISOLATION_HINTS = {
    shared: "A slice of a shared GPU; its memory and SMs are capped in software.",
    mig: "The smallest MIG instance that holds this memory, isolated in hardware.",
    any: "A MIG instance if one is free now, else a shared slice: the scheduler decides.",
  };

  var SHARED_MEMORY_TEXT = { legend: $("gpu-memory-legend").textContent, hint: $("gpu-memory-hint").textContent };

  function isolation() {
    if ($("isolation-field").hidden) return "shared";
    var checked = document.querySelector('#isolation-field input[name="isolation"]:checked');
    return checked ? checked.value : "shared";
  }

  function renderIsolationChoice() {
    var mig = migOptions();
    var offered = !!(mig && mig.isolation && mig.isolation.indexOf("mig") !== -1);
    $("isolation-field").hidden = !offered;
    renderIsolation();
  }

  // A MIG instance (or either) is one GPU sized by memory: count, cores and a share do not apply.
  function renderIsolation() {
    var value = isolation(), sized = value !== "shared";
    $("isolation-hint").textContent = ISOLATION_HINTS[value];
    // One GPU sized by memory alone: no count, no cores (a MIG instance's come with its profile).
    ["memory-intro", "memory-shape", "gpu-memory-share-choice", "gpu-memory-share-box"].forEach(function (id) {
      $(id).hidden = sized;
    });
    $("gpu-memory-legend").textContent = sized ? "GPU memory" : SHARED_MEMORY_TEXT.legend;
    $("gpu-memory-hint").textContent = sized ? "e.g. 15G, 20GiB or 4096M: the instance holds at least this much"
      : SHARED_MEMORY_TEXT.hint;
    ["gpu-count-hami", "gpu-cores", "gpu-memory-by-percent", "gpu-memory-percent"].forEach(function (id) {
      $(id).disabled = sized;
    });
    if (sized) {
      $("gpu-count-hami").value = "1";
      if (!memBySize.checked) { memBySize.checked = true; renderMemoryMode(); }
    }
  }

  $("isolation-field").addEventListener("change", function () { renderIsolation(); });

  function selectTab(style, focus) {
    var offered = styleOffered(style);
    tabs.forEach(function (t) {
      var on = t.dataset.style === style;
      var panel = $(t.getAttribute("aria-controls"));
      t.setAttribute("aria-selected", on ? "true" : "false");
      t.tabIndex = on ? 0 : -1;
      panel.hidden = !on || !offered;
      panel.querySelector(".panel-fields").disabled = !on || !offered; // off-tab inputs neither validate nor submit
      if (on && focus) t.focus();
    });
    $("style-note").textContent = offered ? "" : UNAVAILABLE[style] || "";
    $("style-note").hidden = offered;
    $("capacity-note").hidden = !(offered && slotBusy && (style === "fgpu" || style === "devices"));
    $("launch-advanced").hidden = style === "mig" || !offered; // a MIG instance is chosen by the scheduler: no pins
    changed();
  }

  // The user's pick of a style: the tab, and no preset of another style (leavePresetFor).
  function pickStyle(style, focus) {
    wantedStyle = style;
    leavePresetFor(style);
    selectTab(style, focus);
  }

  tabs.forEach(function (t) {
    t.addEventListener("click", function () { pickStyle(t.dataset.style, false); });
  });
  document.querySelector('#style-tabs [role="tablist"]').addEventListener("keydown", function (ev) {
    var shown = tabs.filter(function (t) { return !t.hidden; });
    var i = shown.indexOf(document.activeElement);
    var next = { ArrowRight: shown[(i + 1) % shown.length], ArrowLeft: shown[(i - 1 + shown.length) % shown.length],
                 Home: shown[0], End: shown[shown.length - 1] }[ev.key];
    if (i === -1 || !next) return;
    ev.preventDefault();
    pickStyle(next.dataset.style, true);
  });

  // Memory per GPU is a size or a share: typing into either box picks it.
  var memBySize = $("gpu-memory-by-size"), memByPercent = $("gpu-memory-by-percent");
  function renderMemoryMode() {
    $("gpu-memory").classList.toggle("is-inactive", !memBySize.checked);
    $("gpu-memory-percent").classList.toggle("is-inactive", memBySize.checked);
  }
  function pickMemoryMode(radio) {
    if (radio.checked) return;
    radio.checked = true;
    renderMemoryMode();
    changed();
  }
  $("gpu-memory").addEventListener("focus", function () { pickMemoryMode(memBySize); });
  $("gpu-memory-percent").addEventListener("focus", function () { pickMemoryMode(memByPercent); });
  [memBySize, memByPercent].forEach(function (radio) {
    radio.addEventListener("change", function () {
      renderMemoryMode();
      $(memBySize.checked ? "gpu-memory" : "gpu-memory-percent").focus();
    });
  });

  // ---- Validation: obvious mistakes here, the rest by the server's preview --

  var SIZE = /^\s*\d+(\.\d+)?\s*([kmgtp]i?b?|b)?\s*$/i;
  var FRACTION = /^\s*(0?\.\d+|0|1|[01]\.\d*)\s*$/;
  var serverErrors = {}; // input id -> message from the last preview's 400

  function whole(input, lo, hi) {
    var v = input.value.trim();
    return !input.validity.badInput && /^\d+$/.test(v) && Number(v) >= lo && (hi === undefined || Number(v) <= hi);
  }

  function clientErrors() {
    var errors = {}, style = activeStyle();
    if (style === "memory") {
      var shared = isolation() === "shared";
      if (shared && !whole($("gpu-count-hami"), 1)) errors["gpu-count-hami"] = "A whole number of GPUs, 1 or more.";
      var cores = $("gpu-cores");
      if (shared && (cores.value.trim() !== "" || cores.validity.badInput) && !whole(cores, 0, 100))
        errors["gpu-cores"] = "Enter a whole % from 0 to 100.";
      if (memBySize.checked) {
        var size = $("gpu-memory").value;
        if (!size.trim()) errors["gpu-memory"] = "Enter the memory each GPU gives, e.g. 4G.";
        else if (!SIZE.test(size)) errors["gpu-memory"] = "Not a size: try 4G, 4GiB, 4096M or a number of bytes.";
      } else if (!whole($("gpu-memory-percent"), 1, 100)) {
        errors["gpu-memory-percent"] = "A share of each GPU's memory from 1 to 100 %.";
      }
    } else if (style === "fraction") {
      var f = $("gpu-fraction").value;
      if (!FRACTION.test(f) || decCompare(f.trim(), "0") <= 0 || decCompare(f.trim(), "1") > 0)
        errors["gpu-fraction"] = "A fraction above 0 and at most 1, e.g. 0.2.";
    } else if (style === "mig" && !chosenProfile()) {
      errors["mig-profiles"] = "Choose a MIG profile.";
    }
    if (style && !styleOffered(style)) errors.style = UNAVAILABLE[style]; // shown in #style-note; no launch, no preview
    if (style && pinnedDevices().some(function (d) { return /\s/.test(String(d)); }))
      errors["pin-devices"] = "Separate the GPUs with commas.";
    return errors;
  }

  // Error boxes sit under their field; the share box reports under the memory field.
  var ERROR_BOX = { "gpu-memory-percent": "gpu-memory-error", "mig-profiles": "mig-profile-error",
                    "isolation-field": "isolation-error", "image-select": "image-error" };
  var ERROR_FIELDS = ["session-name", "gpu-count-hami", "gpu-cores", "gpu-memory", "gpu-memory-percent", "gpu-fraction", "pin-devices",
                      "mig-profiles", "isolation-field", "image-select"];

  function validate() {
    var errors = clientErrors();
    var shown = {};
    ERROR_FIELDS.forEach(function (id) {
      var message = errors[id] || serverErrors[id] || "";
      var box = $(ERROR_BOX[id] || id + "-error");
      $(id).setAttribute("aria-invalid", message ? "true" : "false");
      if (message || !shown[box.id]) { box.textContent = message; box.hidden = !message; }
      if (message) shown[box.id] = true;
    });
    var ok = Object.keys(errors).length === 0;
    submit.disabled = launching || !ok;
    return ok;
  }

  // ---- The request body: the active tab's style, cpu/mem/name, advanced options --

  function pinnedDevices() {
    return $("pin-devices").value.split(",").map(function (d) { return d.trim(); })
      .filter(Boolean).map(function (d) { return /^\d+$/.test(d) ? Number(d) : d; });
  }

  // ---- Image picker: the registered session images, the default pre-selected ----

  var imageSelect = $("image-select");
  var images = readJson("session-images") || [];
  var wantedImage = null; // the image the user picked last; kept while it is registered

  // The server's default: the image marked default, else the built-in "host" (sessions.policy.images.image_default).
  function defaultImage() {
    return images.filter(function (i) { return i.is_default; })[0] ||
      images.filter(function (i) { return i.reference === HOST_IMAGE; })[0] || images[0] || null;
  }

  function chosenImage() {
    for (var i = 0; i < images.length; i++) if (images[i].reference === imageSelect.value) return images[i];
    return null;
  }

  function applyImages(list) {
    images = list || [];
    var keep = images.some(function (i) { return i.reference === wantedImage; });
    imageSelect.textContent = "";
    images.forEach(function (i) {
      imageSelect.appendChild(el("option", {
        value: i.reference,
        text: (i.display_name ? i.display_name + " · " : "") + i.reference + (i.is_default ? " (default)" : ""),
      }));
    });
    var fallback = defaultImage();
    imageSelect.value = keep ? wantedImage : (fallback ? fallback.reference : "");
    $("image-field").hidden = images.length === 0;
    renderImageHint();
  }

  // The chosen image in sentences: its description, the accelerators it is for, where it is.
  function renderImageHint() {
    var image = chosenImage();
    var sentences = [];
    if (image) {
      if (image.description) sentences.push(String(image.description).trim().replace(/([^.!?])$/, "$1."));
      if (image.accelerators && image.accelerators.length) sentences.push("For " + image.accelerators.join(", ") + " sessions.");
      sentences.push(image.nodes && image.nodes.length ? "On " + image.nodes.join(", ") + "."
        : "No node has it now: a session in it waits until one does.");
    }
    $("image-hint").textContent = sentences.join(" ");
  }

  imageSelect.addEventListener("change", function () { wantedImage = imageSelect.value; renderImageHint(); });

  // ---- Resource presets: offered first; picking one fills the fields below ----------------
  // The body then names the preset and sends only what the user changed since (sessions.admission.presets
  // merges it: any GPU key replaces the preset's GPU request, null removes a key), so an
  // untouched preset launches exactly its request, also where the fields cannot show it.

  var presets = [];
  var presetId = ""; // the preset picked ("" = Custom)
  var presetBaseline = null; // launchBody() right after the fields were filled from it
  var PRESET_OPTION_KEYS = ["cpu", "mem", "devices", "exclude", "policy", "numa", "strategy", "resource_group"];

  function chosenPreset() {
    for (var i = 0; i < presets.length; i++) if (presets[i].id === presetId) return presets[i];
    return null;
  }

  function applyPresets(list) {
    presets = list || [];
    if (!chosenPreset()) { presetId = ""; presetBaseline = null; presetStyle = null; ownFields = null; }
    var box = $("preset-options");
    box.textContent = "";
    $("preset-field").hidden = presets.length === 0;
    var row = function (id, value, name, description, request, chip) {
      var input = el("input", { type: "radio", name: "preset", id: id, value: value });
      input.checked = value === presetId;
      var title = el("span", { "class": "preset-name", text: name });
      if (chip) title.appendChild(el("span", { "class": "preset-chip", text: chip }));
      var text = el("span", { "class": "preset-text" }, [title]);
      if (description) text.appendChild(el("span", { "class": "preset-description", text: description }));
      return el("label", { "class": "preset-option", "for": id },
                [input, text].concat(request ? [el("span", { "class": "preset-request", text: request })] : []));
    };
    box.appendChild(row("preset-custom", "", "Custom", "Set the request yourself below", ""));
    presets.forEach(function (p) {
      box.appendChild(row("preset-" + p.id, p.id, p.name, p.description, p.configuration || JSON.stringify(p.request),
                          p.resource_group ? "in " + p.resource_group : ""));
    });
  }

  function refreshPresets() {
    return api("GET", API_PRESETS).then(function (r) {
      if (r.ok && r.data && Array.isArray(r.data.results)) applyPresets(r.data.results);
    }).catch(function () { /* no picker: the fields work as ever */ });
  }

  // "8G" for whole GiB, "512M" for whole MiB, else bytes: what the host memory field takes.
  function sizeText(bytes) {
    var n = Number(bytes);
    if (n && n % 1073741824 === 0) return n / 1073741824 + "G";
    if (n && n % 1048576 === 0) return n / 1048576 + "M";
    return String(bytes);
  }

  // The GPU part of a preset's request into the tabs: the style, its fields, the options.
  function fillPresetGpu(req) {
    var key = Object.keys(req).filter(function (k) { return /\.(shares|device)$/.test(k); })[0];
    var hasOption = function (select, v) { return Array.prototype.some.call(select.options, function (o) { return o.value === v; }); };
    if (key) {
      if (hasOption(slotSelect, key)) slotSelect.value = key;
      if (/\.shares$/.test(key)) { wantedStyle = "fgpu"; slider.dataset.wanted = String(req[key]); }
      else { wantedStyle = "devices"; gpuCount.value = String(req[key]); }
      $("fgpu-strategy").value = req.strategy || "";
    } else if (req.gpu_fraction !== undefined) {
      wantedStyle = "fraction";
      $("gpu-fraction").value = String(req.gpu_fraction);
    } else if (req.mig_profile !== undefined) {
      wantedStyle = "mig";
      wantedProfile = String(req.mig_profile);
    } else if (req.gpu !== undefined || req.gpu_memory !== undefined || req.gpu_memory_percentage !== undefined) {
      wantedStyle = "memory";
      $("isolation-" + (req.isolation || "shared")).checked = true;
      $("gpu-count-hami").value = String(req.gpu || 1);
      $("gpu-cores").value = req.gpu_cores !== undefined ? String(req.gpu_cores) : "";
      memBySize.checked = req.gpu_memory_percentage === undefined;
      memByPercent.checked = !memBySize.checked;
      if (req.gpu_memory !== undefined) $("gpu-memory").value = String(req.gpu_memory);
      if (req.gpu_memory_percentage !== undefined) $("gpu-memory-percent").value = String(req.gpu_memory_percentage);
      renderMemoryMode();
    } else if (!Object.keys(req).some(function (k) { return PRESET_OPTION_KEYS.indexOf(k) === -1; })) {
      slotSelect.value = CPU_ONLY; // no GPU key: a CPU-only preset
      slotSelect.dataset.touched = "1";
    } // other styles (HAMi names, eGPU): the fields stay; the preset's own request is sent
    if (hasOption($("policy-select"), req.policy || "")) $("policy-select").value = req.policy || "";
    $("numa-only").checked = req.numa === true;
    $("pin-devices").value = (req.devices || []).join(", ");
    renderSlot();
    renderIsolation();
  }

  function fillFromPreset(p) {
    var req = p.request || {};
    presetBaseline = null;
    fillPresetGpu(req);
    $("cpu-count").value = String(req.cpu || 1);
    $("mem-size").value = sizeText(req.mem || 1073741824);
    if (p.image && images.some(function (i) { return i.reference === p.image; })) wantedImage = p.image;
    var image = p.image ? wantedImage : (defaultImage() || {}).reference;
    if (image) { imageSelect.value = image; renderImageHint(); }
    presetBaseline = launchBody();
    $("preset-hint").textContent = "Filled in below from " + p.name +
      (p.resource_group ? ", which launches in resource group " + p.resource_group : "") +
      ". What you change replaces that part of the preset.";
  }

  // The dialog shows what it sends (issue 36.6): a preset stays picked only while its request
  // style is the tab shown, and Custom is the user's own request. Picking a preset over Custom
  // keeps the user's fields (ownFields) and Custom gives them back, so a preset tried and left
  // never leaves its values in the user's tabs; moving to another style's tab leaves the preset
  // for Custom, which then sends the fields as they stand (the preset's CPU and memory included).
  var FIELD_VALUES = ["gpu-count-hami", "gpu-cores", "gpu-memory", "gpu-memory-percent", "gpu-fraction", "gpu-count",
                      "fgpu-strategy", "policy-select", "pin-devices", "cpu-count", "mem-size"];
  var FIELD_CHECKS = ["gpu-memory-by-size", "gpu-memory-by-percent", "isolation-shared", "isolation-mig", "isolation-any",
                      "numa-only"];
  var ownFields = null; // the fields as the user set them, while a preset has filled them
  var presetStyle = null; // the tab the picked preset's request shows in

  function fieldsNow() {
    var state = { values: {}, checks: {}, style: activeStyle() || wantedStyle, profile: wantedProfile, slot: slotSelect.value,
                  touched: slotSelect.dataset.touched, amount: slider.dataset.wanted, image: wantedImage };
    FIELD_VALUES.forEach(function (id) { state.values[id] = $(id).value; });
    FIELD_CHECKS.forEach(function (id) { state.checks[id] = $(id).checked; });
    return state;
  }

  function fieldsRestore(state) {
    FIELD_VALUES.forEach(function (id) { $(id).value = state.values[id]; });
    FIELD_CHECKS.forEach(function (id) { $(id).checked = state.checks[id]; });
    slotSelect.value = state.slot;
    if (state.touched) slotSelect.dataset.touched = state.touched; else delete slotSelect.dataset.touched;
    if (state.amount) slider.dataset.wanted = state.amount; else delete slider.dataset.wanted;
    wantedStyle = state.style;
    wantedProfile = state.profile;
    wantedImage = state.image;
    var image = images.some(function (i) { return i.reference === wantedImage; }) ? wantedImage : (defaultImage() || {}).reference;
    if (image) { imageSelect.value = image; renderImageHint(); }
    renderMemoryMode();
    renderSlot();
    renderIsolation();
  }

  function presetNone(hint) {
    presetId = "";
    presetBaseline = null;
    presetStyle = null;
    ownFields = null;
    $("preset-custom").checked = true;
    $("preset-hint").textContent = hint;
  }

  // A tab of another style than the picked preset's: the request is the user's own from here.
  function leavePresetFor(style) {
    var p = chosenPreset();
    if (!p || style === presetStyle) return;
    presetNone("Custom: the request below as it stands, started from " + p.name + ".");
  }

  $("preset-options").addEventListener("change", function (ev) {
    var before = chosenPreset();
    presetId = ev.target.value;
    var p = chosenPreset();
    if (p) {
      if (!before) ownFields = fieldsNow();
      fillFromPreset(p);
      presetStyle = activeStyle();
    } else {
      var own = ownFields;
      presetNone("Set the request yourself below.");
      if (own) fieldsRestore(own);
    }
    changed();
  });

  // With a preset picked: `{"name", "preset", "resources": what changed, "image" if changed}`.
  function presetBody(body) {
    var p = chosenPreset();
    if (!p || !presetBaseline) return body;
    var base = presetBaseline.resources, now = body.resources, diff = {}, gpuChanged = false;
    var isOption = function (k) { return PRESET_OPTION_KEYS.indexOf(k) !== -1; };
    Object.keys(base).concat(Object.keys(now)).forEach(function (k) {
      if (JSON.stringify(base[k]) === JSON.stringify(now[k])) return;
      if (isOption(k)) diff[k] = k in now ? now[k] : null;
      else gpuChanged = true;
    });
    if (gpuChanged) { // one request style per session: the whole GPU part, and nulls for the preset's keys it drops
      Object.keys(base).forEach(function (k) { if (!isOption(k) && !(k in now)) diff[k] = null; });
      Object.keys(now).forEach(function (k) { if (!isOption(k)) diff[k] = now[k]; });
    }
    var out = { name: body.name, preset: p.id };
    if (Object.keys(diff).length) out.resources = diff;
    if (body.image && body.image !== presetBaseline.image) out.image = body.image;
    return out;
  }

  function launchBody() {
    var resources = {}, slot = currentSlot(), style = activeStyle(), gpu = false;
    if (style === "devices") {
      var n = parseInt(gpuCount.value || "0", 10);
      if (n > 0) { resources[slot.slot] = n; gpu = true; }
    } else if (style === "fgpu" && !slider.disabled) {
      resources[slot.slot] = slider.value;
      if ($("fgpu-strategy").value) resources.strategy = $("fgpu-strategy").value;
      gpu = true;
    } else if (style === "memory" && isolation() !== "shared") {
      resources.gpu_memory = $("gpu-memory").value.trim();
      resources.isolation = isolation();
      gpu = true;
    } else if (style === "memory") {
      resources.gpu = parseInt($("gpu-count-hami").value, 10);
      if (memBySize.checked) resources.gpu_memory = $("gpu-memory").value.trim();
      else resources.gpu_memory_percentage = parseInt($("gpu-memory-percent").value, 10);
      if ($("gpu-cores").value.trim() !== "") resources.gpu_cores = parseInt($("gpu-cores").value, 10);
      gpu = true;
    } else if (style === "fraction") {
      resources.gpu_fraction = $("gpu-fraction").value.trim().replace(/^\./, "0.");
      gpu = true;
    } else if (style === "mig") {
      resources.mig_profile = chosenProfile();
    }
    if (gpu) {
      var pinned = pinnedDevices();
      if (pinned.length) resources.devices = pinned;
      if ($("policy-select").value) resources.policy = $("policy-select").value;
      if ($("numa-only").checked) resources.numa = true;
    }
    resources.cpu = parseInt($("cpu-count").value, 10);
    resources.mem = $("mem-size").value.trim();
    var body = { name: $("session-name").value.trim(), resources: resources };
    if (images.length && imageSelect.value) body.image = imageSelect.value;
    return presetBody(body);
  }

  // ---- Preview: POST the same body to the preview endpoint, debounced ------

  // Empty when the server has no preview route: the dialog then works without one.
  var previewUrl = form.getAttribute("data-preview-url") || "";
  var preview = $("launch-preview");
  var previewTimer = null;
  var previewSeq = 0;
  var previewRefused = false; // the last answer: the server would refuse this launch (Launch stays off until one says not)
  var INPUT_OF = {
    name: "session-name", gpu: "gpu-count-hami", gpu_memory: "gpu-memory", gpu_memory_percentage: "gpu-memory-percent",
    gpu_cores: "gpu-cores", gpu_fraction: "gpu-fraction", devices: "pin-devices", mig_profile: "mig-profiles",
    isolation: "isolation-field", image: "image-select",
  };

  function changed() {
    validate();
    schedulePreview();
  }

  function schedulePreview() {
    if (previewRefused) submit.disabled = true;
    clearTimeout(previewTimer);
    if (!previewUrl || !dialog.open) return;
    preview.setAttribute("data-pending", ""); // until this request's answer is shown (tests wait on it; no style)
    previewTimer = setTimeout(runPreview, 250);
  }

  function hidePreview() {
    previewRefused = false;
    previewSeq++; // answers still on their way are stale now
    preview.hidden = true;
    preview.removeAttribute("aria-busy");
    preview.removeAttribute("data-pending");
  }

  function runPreview() {
    previewTimer = null;
    var inputsOk = $("cpu-count").checkValidity() && $("mem-size").checkValidity();
    if (!validate() || !inputsOk || !previewUrl) { hidePreview(); return; }
    var seq = ++previewSeq;
    preview.setAttribute("aria-busy", "true");
    api("POST", previewUrl, launchBody()).then(function (r) {
      if (seq !== previewSeq) return;
      preview.removeAttribute("aria-busy");
      if (r.ok && r.data) renderPreview(r.data);
      else if (r.status === 400 && r.data) renderInvalid(r.data);
      else {
        if (r.status === 404 || r.status === 405) previewUrl = ""; // no preview on this server
        hidePreview();
      }
      if (!previewTimer) preview.removeAttribute("data-pending");
    }).catch(function () { if (seq === previewSeq) hidePreview(); });
  }

  function trimZeros(value) {
    return String(value).replace(/(\.\d*?)0+$/, "$1").replace(/\.$/, "");
  }

  function showPreview(state, line) {
    preview.setAttribute("data-state", state);
    $("preview-line").textContent = line;
    preview.hidden = false;
  }

  var DEVICE_REFUSALS = ["unknown-device", "device-not-in-group", "device-not-usable"]; // sessions.scheduling.placement._never

  function renderPreview(data) {
    serverErrors = {};
    if (data.name_error) serverErrors["session-name"] = data.name_error; // a name taken: said under Name
    // A pinned device no node in reach has: said under "Only these GPUs" too, opened to show it.
    if (data.never && DEVICE_REFUSALS.indexOf(data.refusal) !== -1) {
      serverErrors["pin-devices"] = data.reason;
      $("launch-advanced").open = true;
    }
    validate();
    var never = data.never_detail || null; // a request too large in parts: asked, the most any node gives, what to do
    if (data.refusal === "name-taken") showPreview("invalid", "not valid: name in use");
    else if (data.fits_now) showPreview("now", "starts now" + (data.node ? " on " + data.node : ""));
    else if (data.never && DEVICE_REFUSALS.indexOf(data.refusal) !== -1) // its first sentence; the whole under the field
      showPreview("never", "cannot launch: " + String(data.reason).replace(/^devices: /, "").split(/(?<=\.) /)[0]);
    else if (data.never && never) showPreview("never", "too large for any node");
    else if (data.never) showPreview("never", "too large: " + (data.reason || "no node could ever hold it"));
    else if (data.outcome === "refused") showPreview("never", "would be refused: " + (data.reason || "over your quota"));
    else showPreview("wait", "will wait: " + (data.reason || "no capacity is free now"));
    // A launch the server would refuse (never fits, or a quota): Launch is off, the line says why.
    var refused = data.outcome === "refused" || data.never === true;
    previewRefused = refused;
    if (refused) submit.disabled = true;
    if (refused) submit.setAttribute("aria-describedby", "preview-line");
    else submit.removeAttribute("aria-describedby");
    var list = $("preview-never");
    list.textContent = "";
    if (data.never && never) ["asked", "most", "advice"].forEach(function (k) {
      if (never[k]) list.appendChild(el("li", { "class": "preview-never-" + k, text: never[k] }));
    });
    list.hidden = !(data.never && never);
    var eta = previewEtaText(data);
    $("preview-eta").textContent = eta;
    $("preview-eta").hidden = !eta;
    $("preview-config").textContent = data.configuration || "";
    $("preview-config").hidden = !data.configuration;
    var mig = data.mig || null;
    $("preview-mig").textContent = mig ? "Gets MIG " + mig.profile + ": " + mig.plan : "";
    $("preview-mig").hidden = !mig;
    $("preview-storage").textContent = data.storage_note || "";  // its data folders are local to that node
    $("preview-storage").hidden = !data.storage_note;
    var devices = Array.isArray(data.devices) ? data.devices : [];
    var body = $("preview-devices").tBodies[0];
    body.textContent = "";
    devices.forEach(function (d) {
      var compute = [];
      if (d.procs !== undefined && d.procs !== null) compute.push(trimZeros(d.procs) + "\u00a0SMs");
      if (d.sm_percent !== undefined && d.sm_percent !== null) compute.push(trimZeros(d.sm_percent) + "\u00a0%");
      body.appendChild(el("tr", {}, [
        el("td", { "class": "preview-device" }, [
          el("span", { "class": "preview-device-name", text: "GPU " + d.device_index + (d.model_name ? " · " + d.model_name : "") }),
          el("span", { "class": "preview-uuid", text: d.device || "", title: d.device || "" }),
        ]),
        el("td", { "class": "num", text: d.memory !== undefined && d.memory !== null ? formatBytes(d.memory) : "—" }),
        el("td", { "class": "num", text: compute.join(" · ") || "—" }),
        el("td", { "class": "num preview-share",
                   text: mig ? "MIG " + mig.profile : wholeDevices() ? "whole" : d.shares ? formatAmount(d.shares, 2) + " " + fgpuUnit() : "—" }),
      ]));
    });
    $("preview-devices").hidden = devices.length === 0;
  }

  // When a request that waits would start (the preview's `eta`: a band from the queue's replay,
  // as a pending session's "When will I start?" panel gives it; sessions.api.eta.preview_eta).
  function previewEtaText(data) {
    var e = data.eta;
    if (!e || data.fits_now || e.outcome === "never" || e.outcome === "now") return "";
    var place = e.position ? " · place " + e.position + " in the queue" : "";
    if (e.outcome !== "estimate" || !e.earliest) return "No estimate of when it starts" + (e.reason ? ": " + e.reason : "") + place;
    var hm = function (iso) {
      return new Date(iso).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", hour12: false });
    };
    var a = hm(e.earliest), b = e.latest ? hm(e.latest) : "";
    var when = !b ? "from " + a + " (latest unknown)" : a === b ? "at " + a : a + " – " + b;
    var due = new Date(e.earliest).getTime() <= Date.now() + 30000 ? " (any moment)" : "";
    return "Expected to start " + when + due + place;
  }

  // Whole devices asked (a slot in discrete mode, its Whole GPUs tab): each is the session's alone.
  function wholeDevices() {
    var slot = currentSlot();
    return activeStyle() === "devices" && !!slot && slot.allocation_mode === "discrete";
  }

  function fgpuUnit() {
    var slots = launchOptions.slots || [];
    for (var i = 0; i < slots.length; i++) if (slots[i].allocation_mode !== "discrete") return slots[i].display_unit || "fGPU";
    return "fGPU";
  }

  // A 400 from the preview: the reason in the box, and under the field it names where there is one.
  function renderInvalid(data) {
    serverErrors = {};
    var fe = data.field_errors || {};
    Object.keys(fe).forEach(function (key) {
      var message = [].concat(fe[key]).join(" ");
      var id = INPUT_OF[key.replace(/^resources\./, "")];
      if (!id && key === "resources") { // "resources.gpu_cores: at most 100"
        var named = message.match(/^resources\.(\w+):/);
        id = named && INPUT_OF[named[1]];
      }
      if (id && ERROR_FIELDS.indexOf(id) !== -1 && !$(id).closest("fieldset:disabled")) serverErrors[id] = message;
    });
    validate();
    // A taken name is said in full under the name field: here its title ("Name in use").
    var said = data.type === "name-taken" && data.title ? data.title.toLowerCase() : data.detail || data.title;
    showPreview("invalid", "not valid: " + (said || "the server refused this request"));
    $("preview-never").hidden = true;
    $("preview-config").hidden = true;
    $("preview-eta").hidden = true;
    $("preview-mig").hidden = true;
    $("preview-devices").hidden = true;
  }

  form.addEventListener("input", function () { serverErrors = {}; changed(); });
  form.addEventListener("change", function () { serverErrors = {}; changed(); });

  // The name the dialog offers: the server's next default for this user (sessions.lifecycle.services.
  // session_default_name), moved on past each "session-<n>" of theirs launched since.
  var defaultName = listState.default_name || "session-1";
  function nameTaken(s) {
    if (!s || (s.owner && s.owner !== fgpu.me)) return;
    var taken = /^session-(\d+)$/.exec(s.name || ""), offered = /^session-(\d+)$/.exec(defaultName);
    if (taken && offered && Number(taken[1]) >= Number(offered[1])) defaultName = "session-" + (Number(taken[1]) + 1);
  }

  function showErrors(result) {
    errorBox.textContent = "";
    var data = result.data || {};
    // A taken name is said in full under the name field: the alert gives its title ("Name in use").
    var title = data.type === "name-taken" && data.title ? data.title : errorText(result);
    errorBox.appendChild(el("p", { "class": "alert-title", text: title }));
    var fe = data.field_errors || {};
    var items = [];
    Object.keys(fe).forEach(function (field) {
      var msgs = Array.isArray(fe[field]) ? fe[field] : [fe[field]];
      msgs.forEach(function (m) {
        var text = typeof m === "string" ? m : JSON.stringify(m);
        if (title.indexOf(text) !== -1 || (field === "name" && data.type === "name-taken")) return; // said already
        items.push(el("li", {}, [el("span", { "class": "field-key", text: field }), ": " + text]));
      });
    });
    if (items.length) errorBox.appendChild(el("ul", {}, items));
    errorBox.hidden = false;
    if (fe.name) serverErrors["session-name"] = [].concat(fe.name).join(" "); // under the field too, until it changes
    $("session-name").setAttribute("aria-invalid", fe.name ? "true" : "false");
    errorBox.scrollIntoView({ block: "nearest" });
  }

  function openDialog() {
    errorBox.hidden = true;
    hidePreview();
    serverErrors = {};
    $("session-name").value = defaultName;
    $("session-name").removeAttribute("aria-invalid");
    applyOptions(launchOptions);
    dialog.showModal();
    $("session-name").select();
    schedulePreview();
    var status = $("options-status");
    status.textContent = "Checking free capacity…";
    api("GET", API_OPTIONS).then(function (r) {
      if (!r.ok || !r.data) { status.textContent = "Could not refresh free capacity."; return; }
      applyOptions(r.data);
      status.textContent = "";
    }).catch(function () { status.textContent = "Could not refresh free capacity."; });
    api("GET", API_IMAGES).then(function (r) {
      if (r.ok && r.data && Array.isArray(r.data.results)) { applyImages(r.data.results); schedulePreview(); }
    }).catch(function () { /* the images rendered with the page stay */ });
    refreshPresets();
  }

  $("start-session").addEventListener("click", openDialog);
  dialog.querySelectorAll("[data-close]").forEach(function (b) {
    b.addEventListener("click", function () { dialog.close(); });
  });
  // Close when clicking the backdrop.
  dialog.addEventListener("click", function (ev) { if (ev.target === dialog) dialog.close(); });
  dialog.addEventListener("close", function () { clearTimeout(previewTimer); hidePreview(); });

  form.addEventListener("submit", function (ev) {
    ev.preventDefault();
    if (!validate()) return;
    var body = launchBody();
    launching = true;
    submit.disabled = true;
    submit.textContent = "Launching…";
    errorBox.hidden = true;
    api("POST", API_SESSIONS, body).then(function (r) {
      if (r.ok && r.data) {
        dialog.close();
        nameTaken(r.data);
        // Show the new session: on the first page of a view that holds it.
        if (filters.page !== 1 || !matches(r.data)) go({ tab: "all", page: 1 }, true);
        upsert(r.data);
        return;
      }
      showErrors(r);
    }).catch(function () {
      showErrors({ status: 0, data: { detail: "Could not reach the server. Check your connection and try again." } });
    }).then(function () {
      launching = false;
      submit.textContent = "Launch";
      validate();
    });
  });

  // ---- Start -------------------------------------------------------------

  renderFilters();
  replaceAll(readJson("initial-sessions") || []); // the server's rows, drawn as updates draw them
  renderRange();
  setInterval(function () { renderTimes(tbody); }, 30000);
  setInterval(function () { renderElapsed(true); }, 1000);
  applyOptions(launchOptions);
  applyImages(images);
  renderMemoryMode();
  refreshPresets();
  // Live rows; on every (re)connection the page is loaded again, so nothing missed while the
  // connection was down (a server restart, a sleeping laptop) stays on screen.
  fgpu.watchSessions({
    onOpen: function () { setLive("live", "Live"); load(); },
    onSession: function (s) { nameTaken(s); upsert(s); },
    onDown: function () { setLive("reconnecting", "Reconnecting…"); },
  });
})();
