// Usage pictures (issue 15), one script for the three pages that show them; each part runs only
// where its element is on the page:
//   - session page (#usage-charts): GPU memory used against the granted limit, GPU utilisation
//     and CPU over the last hour (or day, week, month: the range picker), from
//     GET /api/v1/sessions/<id>/usage/, polled every POLL_MS (the longer ranges every SLOW_POLL_MS);
//   - session list (.usage-gauge in #sessions-body, drawn by sessions.js renderRow): memory used
//     of granted per running session, from GET /api/v1/usage/latest/, polled every POLL_MS;
//   - node admin page (#node-usage-charts): each GPU's memory used and utilisation, from
//     GET /api/v1/nodes/<name>/usage/, with the same range picker.
// Hovering a chart shows the time and every series' value there in its legend (uPlot's cursor).
// Charts are uPlot (static/vendor/uplot). A gap in the samples is a null point, drawn as a break
// in the line, never as a zero. Memory in bytes (shown in binary units), CPU in milli-cores.
(function () {
  "use strict";

  var POLL_MS = 5000;
  var SLOW_POLL_MS = 60000; // a day's, week's or month's chart moves by 5-minute or hourly points
  // The range picker's choices; the server picks the resolution (every sample, 5-minute or hourly means).
  var RANGES = [{ key: "hour", label: "Hour", seconds: 3600, words: "last hour" },
                { key: "day", label: "Day", seconds: 86400, words: "last day" },
                { key: "week", label: "Week", seconds: 7 * 86400, words: "last week" },
                { key: "month", label: "Month", seconds: 30 * 86400, words: "last 30 days" }];
  var FINAL = ["TERMINATED", "ERROR", "CANCELLED"];
  // The charts' colours are the stylesheet's (--chart-* in css/console.css: light-dark() pairs, so
  // the grid and lines read on the light theme and the dark one). A canvas cannot read a CSS
  // variable: each is resolved to rgb() through a probe element, and again when the theme changes.
  var CHART_COLOURS = ["axis", "grid", "tick", "used", "limit", "util", "cpu"];
  var palette = null;
  var charts = [];
  function colours() {
    if (palette) return palette;
    var probe = document.createElement("span");
    probe.hidden = true;
    document.body.appendChild(probe);
    palette = {};
    CHART_COLOURS.forEach(function (name) {
      probe.style.color = "var(--chart-" + name + ")";
      palette[name] = getComputedStyle(probe).color;
    });
    probe.remove();
    return palette;
  }
  function colour(name) { return function () { return colours()[name]; }; }
  // A series' area under its line: its colour, faint.
  function tint(name) {
    return function () { return colours()[name].replace(/^rgb\((.*)\)$/, "rgba($1, 0.1)"); };
  }
  // The theme changes by the toggle (<html data-theme>: the console's static/js/theme.js, or the
  // admin's own) or by the system's setting.
  function themeChanged() {
    palette = null;
    charts.forEach(function (u) {
      u.redraw(false, true);
      // The legend's markers took their colours when the chart was made.
      u.root.querySelectorAll(".u-legend .u-series").forEach(function (row, i) {
        var marker = row.querySelector(".u-marker");
        var s = u.series[i];
        if (marker && i > 0 && s && s.stroke) marker.style.borderColor = s.stroke(u, i);
        if (marker && i > 0 && s && s.fill) marker.style.background = s.fill(u, i);
      });
    });
  }
  new MutationObserver(themeChanged).observe(document.documentElement, { attributes: true, attributeFilter: ["data-theme"] });
  window.matchMedia("(prefers-color-scheme: dark)").addEventListener("change", themeChanged);
  var BIN_UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];
  var MIN_WINDOW_S = 120; // a young session's charts span at least 2 minutes, not a whole hour
  // Tick steps of a bytes axis: binary sizes (1 MiB … 1 TiB in 1-2-4 steps), so ticks read "512 MiB", "1.5 GiB".
  var BYTE_INCRS = [];
  for (var b = 1 << 20; b <= Math.pow(2, 40); b *= 2) BYTE_INCRS.push(b);

  // 1610612736 -> "1.5 GiB" (binary units, at most two decimals).
  function bytesText(bytes) {
    if (bytes === null || bytes === undefined) return "—";
    var i = 0, v = bytes;
    while (i < BIN_UNITS.length - 1 && v >= 1024) { v /= 1024; i++; }
    return (Math.round(v * 100) / 100) + " " + BIN_UNITS[i];
  }

  function getJson(url) {
    return fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" }).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.json();
    });
  }

  // Polls `tick` every `every()` ms (POLL_MS without it) while the tab is visible (at once when
  // it shows again); `tick` returns a promise, and a poll never overlaps the one before. Returns
  // {stop, now}: `now()` polls at once (after the poll under way, if any).
  function poll(tick, every) {
    var timer = null, stopped = false, running = false, again = false;
    function run() {
      timer = null;
      if (stopped || document.hidden) return;
      running = true;
      Promise.resolve().then(tick).catch(function () { /* shown as stale by the caller */ }).then(function () {
        running = false;
        if (stopped || document.hidden) return;
        if (again) { again = false; run(); return; }
        timer = setTimeout(run, every ? every() : POLL_MS);
      });
    }
    document.addEventListener("visibilitychange", function () {
      if (!document.hidden && timer === null && !running && !stopped) run();
    });
    run();
    var stop = function () { stopped = true; if (timer) clearTimeout(timer); };
    return {
      stop: stop,
      now: function () {
        if (stopped) return;
        if (running) { again = true; return; }
        if (timer) clearTimeout(timer);
        run();
      },
    };
  }

  // The range picker (a segmented control, before `before`): calls `choose(range)` on a click.
  // Returns the chosen range's getter.
  function rangePicker(before, choose) {
    var chosen = RANGES[0];
    var group = document.createElement("div");
    group.className = "usage-range";
    group.setAttribute("role", "group");
    group.setAttribute("aria-label", "Time range of the charts");
    RANGES.forEach(function (range) {
      var button = document.createElement("button");
      button.type = "button";
      button.className = "usage-range-button";
      button.textContent = range.label;
      button.setAttribute("data-range", range.key);
      button.setAttribute("aria-pressed", String(range === chosen));
      button.title = "Show the " + range.words;
      button.addEventListener("click", function () {
        if (chosen === range) return;
        chosen = range;
        group.querySelectorAll("button").forEach(function (b) {
          b.setAttribute("aria-pressed", String(b === button));
        });
        choose(range);
      });
      group.appendChild(button);
    });
    before.parentNode.insertBefore(group, before);
    return function () { return chosen; };
  }

  // ---- Charts ------------------------------------------------------------------------------

  // One uPlot chart in `box` (an element holding .usage-chart-plot and .usage-chart-empty):
  // `series` [{label, colour (a --chart-* name), fill (bool), dash, value(v) -> text}], `yRange` (u, min, max) -> [lo, hi],
  // `yValues` axis tick text. Sized to its box, kept so on resize.
  function chart(box, opts) {
    var plot = box.querySelector(".usage-chart-plot");
    var width = function () { return Math.max(160, plot.clientWidth); };
    var u = new window.uPlot({
      width: width(),
      height: opts.height || 140,
      padding: [10, 24, 0, 0], // room for the last time label
      cursor: { y: false, drag: { x: false, y: false } },
      // Hovering shows the time and each series' value under the cursor in the legend; away from
      // the chart the legend names the series (the newest value is beside the chart's title).
      legend: { show: true, live: true },
      scales: { x: { time: true }, y: { range: opts.yRange } },
      axes: [
        { stroke: colour("axis"), grid: { stroke: colour("grid") }, ticks: { stroke: colour("tick") }, size: 28,
          font: "11px system-ui, sans-serif", values: timeTicks },
        { stroke: colour("axis"), grid: { stroke: colour("grid") }, ticks: { stroke: colour("tick") }, size: opts.axisSize || 56,
          font: "11px system-ui, sans-serif", incrs: opts.incrs, values: function (u, ticks) { return ticks.map(opts.tick); } },
      ],
      series: [{ label: "time", value: function (u, v) { return v === null || v === undefined ? "—" : pointTime(u, v); } }]
        .concat(opts.series.map(function (s) {
          return { label: s.label, stroke: colour(s.colour), width: s.width || 1.5, dash: s.dash, spanGaps: false,
                   fill: s.fill ? tint(s.colour) : undefined, points: { show: false },
                   value: function (u, v) { return v === undefined ? "—" : s.value(v); } };
        })),
    }, [[]].concat(opts.series.map(function () { return []; })), plot);
    charts.push(u);
    if (window.ResizeObserver) {
      new ResizeObserver(function () { if (u.width !== width()) u.setSize({ width: width(), height: u.height }); })
        .observe(plot);
    }
    return {
      plot: u,
      // `columns`: [t[], ys[]...] (epoch s, nulls as gaps); `since`/`until`: the x range shown,
      // narrowed to MIN_WINDOW_S before `until` while the first point is that recent. The label's
      // .usage-chart-now shows the first series' newest known value.
      set: function (columns, since, until) {
        var any = columns.slice(1).some(function (ys) { return ys.some(function (v) { return v !== null; }); });
        box.setAttribute("data-points", String(columns[0].length));
        box.querySelector(".usage-chart-empty").hidden = any;
        u.setData(columns, false);
        var first = columns[0].length ? columns[0][0] : until;
        u.setScale("x", { min: Math.max(since, Math.min(first, until - MIN_WINDOW_S)), max: until });
        var now = box.querySelector(".usage-chart-now");
        if (now) {
          var ys = columns[1], last = null;
          for (var i = ys.length - 1; i >= 0 && last === null; i--) last = ys[i];
          now.textContent = last === null ? "" : opts.series[0].value(last);
        }
      },
    };
  }

  // The x axis in local clock time: hours and minutes, with seconds while the range is short;
  // the day ("26 Nov") once it spans more than a day and a half.
  function timeTicks(u, ticks) {
    var span = u.scales.x.max - u.scales.x.min;
    if (span > 36 * 3600) {
      return ticks.map(function (t) { return new Date(t * 1000).toLocaleDateString([], { day: "numeric", month: "short" }); });
    }
    var fmt = { hour: "2-digit", minute: "2-digit", hour12: false };
    if (span <= 600) fmt.second = "2-digit";
    return ticks.map(function (t) { return new Date(t * 1000).toLocaleTimeString([], fmt); });
  }

  // The time of the point under the cursor, for the legend: the clock time, with the date when
  // the chart spans more than a day.
  function pointTime(u, t) {
    var date = new Date(t * 1000);
    var fmt = { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false };
    if (u.scales.x.max - u.scales.x.min > 86400) return date.toLocaleString([], Object.assign({ day: "numeric", month: "short" }, fmt));
    return date.toLocaleTimeString([], fmt);
  }

  function percentRange(u, min, max) { return [0, Math.max(100, max || 0)]; }

  // ---- Session page --------------------------------------------------------------------------

  function sessionPage(root) {
    var url = root.getAttribute("data-url");
    var badge = document.getElementById("session-status-badge");
    var panel = root.closest(".usage-panel") || root; // the summary line holds the limit and the notes
    var stale = panel.querySelector(".usage-stale");
    var limit = 0;
    var memory = chart(root.querySelector('[data-chart="memory"]'), {
      series: [
        { label: "used", colour: "used", fill: true, value: bytesText },
        { label: "limit", colour: "limit", dash: [6, 4], width: 1, value: bytesText },
      ],
      yRange: function (u, min, max) { return [0, Math.max(limit, max || 0, 1) * 1.05]; },
      tick: bytesText, axisSize: 64, incrs: BYTE_INCRS,
    });
    var util = chart(root.querySelector('[data-chart="util"]'), {
      series: [{ label: "GPU", colour: "util", fill: true,
                 value: function (v) { return v === null ? "—" : v + " %"; } }],
      yRange: percentRange, tick: function (v) { return v + " %"; }, axisSize: 52,
    });
    var cpu = chart(root.querySelector('[data-chart="cpu"]'), {
      series: [{ label: "CPU", colour: "cpu", fill: true,
                 value: function (v) { return v === null ? "—" : (v / 1000).toFixed(2) + " cores"; } }],
      yRange: function (u, min, max) { return [0, Math.max(1000, max || 0) * 1.05]; },
      tick: function (v) { return (v / 1000) + ""; }, axisSize: 40,
    });

    var lastFetch = false; // the session ended: one more fetch draws its last samples, then stop
    var rangeWords = panel.querySelector(".usage-range-label");
    var range = rangePicker(root, function (chosen) {
      if (rangeWords) rangeWords.textContent = chosen.words;
      root.setAttribute("data-range", chosen.key);
      root.querySelectorAll(".usage-chart-empty").forEach(function (p) { p.textContent = "No samples in the " + chosen.words; });
      lastFetch = false;
      poller.now();
    });
    root.setAttribute("data-range", range().key);
    var poller = poll(function () {
      var now = Math.floor(Date.now() / 1000);
      var since = now - range().seconds;
      var asked = range();
      return getJson(url + "?since=" + since).then(function (d) {
        if (asked !== range()) return; // the range changed meanwhile: the next poll draws the new one
        limit = d.gpu_memory_limit || 0;
        var limits = d.t.map(function () { return limit || null; });
        memory.set([d.t, d.gpu_memory, limits], since, now);
        util.set([d.t, d.gpu_util], since, now);
        cpu.set([d.t, d.cpu], since, now);
        panel.querySelector(".usage-limit").textContent = limit ? bytesText(limit) : "—";
        storage(panel.querySelector(".usage-storage"), d);
        panel.querySelector(".usage-resolution").textContent =
            {raw: "every sample", "5m": "5-minute means", "1h": "hourly means"}[d.resolution] || d.resolution;
        stale.hidden = true;
        root.setAttribute("data-state", "live");
        if (badge && FINAL.indexOf(badge.textContent.trim()) !== -1) {
          if (lastFetch) { poller.stop(); root.setAttribute("data-state", "ended"); }
          lastFetch = true;
        }
      }).catch(function () { stale.hidden = false; });
    }, function () { return range().seconds > 3600 ? SLOW_POLL_MS : POLL_MS; });
  }

  // The session's storage (its home and container layer) against the limit its node enforces:
  // "1.2 GiB of 10 GiB" and a meter, from the usage API's storage, storage_limit and storage_t.
  function storage(box, d) {
    if (!box) return;
    var text = box.querySelector(".usage-storage-text");
    var meter = box.querySelector(".usage-storage-meter");
    var known = d.storage !== null && d.storage !== undefined;
    var words = !known ? "not measured yet"
      : d.storage_limit ? bytesText(d.storage) + " of " + bytesText(d.storage_limit) : bytesText(d.storage);
    var pct = known && d.storage_limit ? Math.min(100, d.storage / d.storage_limit * 100) : 0;
    text.textContent = words;
    text.title = known && d.storage_t ? "measured " + new Date(d.storage_t * 1000).toLocaleTimeString() : "";
    meter.setAttribute("aria-valuenow", String(Math.round(pct)));
    meter.setAttribute("aria-valuetext", words);
    meter.classList.toggle("usage-storage-near", pct >= 90);
    meter.querySelector(".usage-storage-fill").style.width = pct + "%";
  }

  // ---- Session list gauges -------------------------------------------------------------------

  // A gauge (sessions.js renderRow) is `.usage-gauge[data-session-id][data-limit]` holding
  // .usage-gauge-bar > .usage-gauge-fill and .usage-gauge-text.
  function listGauges(tbody) {
    var latest = new Map(); // session id -> the newest /api/v1/usage/latest/ row

    function paint(gauge) {
      var row = latest.get(gauge.getAttribute("data-session-id"));
      var limit = row ? row.gpu_memory_limit : Number(gauge.getAttribute("data-limit")) || 0;
      var used = row && row.t !== null ? row.gpu_memory : null;
      var fill = gauge.querySelector(".usage-gauge-fill");
      var text = gauge.querySelector(".usage-gauge-text");
      if (used === null || used === undefined) {
        gauge.setAttribute("data-state", row ? "silent" : "waiting");
        fill.style.width = "0";
        text.textContent = (row ? "no sample" : "—") + " / " + bytesText(limit);
        gauge.title = row ? "No sample in the last minute: usage unknown" : "Waiting for the first sample";
        return;
      }
      var pct = limit ? Math.min(100, used / limit * 100) : 0;
      gauge.setAttribute("data-state", pct >= 90 ? "high" : "ok");
      gauge.setAttribute("data-used", String(used));
      fill.style.width = pct.toFixed(1) + "%";
      text.textContent = bytesText(used) + " / " + bytesText(limit);
      gauge.title = "GPU memory used of granted: " + Math.round(pct) + " %" +
        (row.gpu_util !== null ? " · GPU utilisation " + row.gpu_util + " %" : "");
    }

    function gauges() { return Array.prototype.slice.call(tbody.querySelectorAll(".usage-gauge[data-session-id]")); }

    // Rows are redrawn whole on every notice: a new gauge shows what is known at once.
    new MutationObserver(function () { gauges().forEach(paint); }).observe(tbody, { childList: true });
    gauges().forEach(paint);

    poll(function () {
      var ids = gauges().map(function (g) { return g.getAttribute("data-session-id"); }).slice(0, 200);
      if (!ids.length) return null;
      var q = ids.map(function (id) { return "session=" + encodeURIComponent(id); }).join("&");
      return getJson("/api/v1/usage/latest/?" + q).then(function (d) {
        d.sessions.forEach(function (row) { latest.set(String(row.id), row); });
        gauges().forEach(paint);
      });
    });
  }

  // ---- Node admin page -----------------------------------------------------------------------

  function nodePage(root) {
    var url = root.getAttribute("data-url");
    var charts = null; // [{memory, util, total}] by device order
    var template = function (device) {
      var box = document.createElement("div");
      box.className = "usage-device";
      box.innerHTML = '<h4 class="usage-device-title"></h4><div class="usage-chart-row">' +
        '<div class="usage-chart" data-chart="memory"><div class="usage-chart-label">Memory used <span class="usage-chart-now"></span></div>' +
        '<div class="usage-chart-plot"></div><p class="usage-chart-empty"></p></div>' +
        '<div class="usage-chart" data-chart="util"><div class="usage-chart-label">Utilisation <span class="usage-chart-now"></span></div>' +
        '<div class="usage-chart-plot"></div><p class="usage-chart-empty"></p></div></div>';
      box.querySelectorAll(".usage-chart-empty").forEach(function (p) { p.textContent = "No samples in the " + range().words; });
      box.querySelector(".usage-device-title").textContent =
        "GPU " + device.index + " · " + device.model_name + " · " + bytesText(device.memory_size);
      return box;
    };
    var range = rangePicker(root, function (chosen) {
      root.setAttribute("data-range", chosen.key);
      root.querySelectorAll(".usage-chart-empty").forEach(function (p) { p.textContent = "No samples in the " + chosen.words; });
      poller.now();
    });
    root.setAttribute("data-range", range().key);
    var poller = poll(function () {
      var now = Math.floor(Date.now() / 1000);
      var since = now - range().seconds;
      var asked = range();
      return getJson(url + "?since=" + since).then(function (d) {
        if (asked !== range()) return;
        if (!charts) {
          root.textContent = "";
          if (!d.devices.length) { root.textContent = "This node has no GPU."; return; }
          charts = d.devices.map(function (device) {
            var box = template(device);
            root.appendChild(box);
            var entry = { total: device.memory_size };
            entry.memory = chart(box.querySelector('[data-chart="memory"]'), {
              series: [{ label: "used", colour: "used", fill: true, value: bytesText }],
              yRange: function () { return [0, entry.total]; }, tick: bytesText, axisSize: 64, incrs: BYTE_INCRS,
            });
            entry.util = chart(box.querySelector('[data-chart="util"]'), {
              series: [{ label: "GPU", colour: "util", fill: true,
                         value: function (v) { return v === null ? "—" : v + " %"; } }],
              yRange: percentRange, tick: function (v) { return v + " %"; }, axisSize: 52,
            });
            return entry;
          });
        }
        d.devices.forEach(function (device, i) {
          var entry = charts[i];
          if (!entry) return;
          entry.total = device.memory_size;
          entry.memory.set([device.t, device.memory_used], since, now);
          entry.util.set([device.t, device.util], since, now);
        });
      });
    }, function () { return range().seconds > 3600 ? SLOW_POLL_MS : POLL_MS; });
  }

  function start() {
    if (typeof window.uPlot !== "function") {
      document.querySelectorAll(".usage-chart-empty").forEach(function (p) { p.textContent = "The chart library did not load."; });
    }
    var sessionRoot = document.getElementById("usage-charts");
    if (sessionRoot && window.uPlot) sessionPage(sessionRoot);
    var nodeRoot = document.getElementById("node-usage-charts");
    if (nodeRoot && window.uPlot) nodePage(nodeRoot);
    var tbody = document.getElementById("sessions-body");
    if (tbody) listGauges(tbody);
  }

  // The admin loads its Media scripts in <head>: wait for the page there.
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
