// The console's colour theme, before the first paint: loaded without defer in <head>, it sets
// <html data-theme> from localStorage["theme"] ("light", "dark", or "auto": the system's, through
// prefers-color-scheme), the key and values Django's admin uses, so the console and the admin
// keep one choice. static/css/console.css resolves its light-dark() colours from it.
// Once the page is parsed: the top bar's theme toggle (system → light → dark) and the phone
// menu's button; and any [data-click="<id>"] button, which stands for the button of that id.
(function () {
  "use strict";

  var KEY = "theme";
  var THEMES = ["auto", "light", "dark"];
  var LABELS = { auto: "Theme: system", light: "Theme: light", dark: "Theme: dark" };
  var root = document.documentElement;

  function stored() {
    try {
      var value = window.localStorage.getItem(KEY);
      return THEMES.indexOf(value) >= 0 ? value : "auto";
    } catch (e) {
      return "auto";  // storage blocked: follow the system
    }
  }

  function apply(theme) {
    root.setAttribute("data-theme", theme);
    var toggle = document.getElementById("theme-toggle");
    if (toggle) {
      var label = LABELS[theme] + (theme === "auto" ? " (" + (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light") + ")" : "");
      toggle.setAttribute("aria-label", label + ". Change theme");
      toggle.title = label;
    }
  }

  apply(stored());
  root.classList.add("js");

  document.addEventListener("DOMContentLoaded", function () {
    apply(stored());
    var toggle = document.getElementById("theme-toggle");
    if (toggle) {
      toggle.addEventListener("click", function () {
        var next = THEMES[(THEMES.indexOf(stored()) + 1) % THEMES.length];
        try { window.localStorage.setItem(KEY, next); } catch (e) { /* this page only */ }
        apply(next);  // canvases (static/js/usage.js's charts) watch data-theme and redraw
      });
    }
    // The toggle's label names the system's theme while it follows it.
    matchMedia("(prefers-color-scheme: dark)").addEventListener("change", function () { apply(stored()); });
    // Another tab (or the admin) changed it.
    window.addEventListener("storage", function (ev) {
      if (ev.key !== KEY) return;
      apply(stored());
    });

    var menuButton = document.getElementById("menu-toggle");
    var nav = document.getElementById("main-nav");
    if (menuButton && nav) {
      var setOpen = function (open) {
        menuButton.setAttribute("aria-expanded", open ? "true" : "false");
        nav.classList.toggle("is-open", open);
      };
      menuButton.addEventListener("click", function () {
        setOpen(menuButton.getAttribute("aria-expanded") !== "true");
      });
      document.addEventListener("keydown", function (ev) {
        if (ev.key === "Escape" && menuButton.getAttribute("aria-expanded") === "true") {
          setOpen(false);
          menuButton.focus();
        }
      });
      document.addEventListener("click", function (ev) {
        if (!nav.contains(ev.target) && !menuButton.contains(ev.target)) setOpen(false);
      });
    }

    document.addEventListener("click", function (ev) {
      var stand = ev.target.closest && ev.target.closest("[data-click]");
      if (!stand) return;
      var target = document.getElementById(stand.getAttribute("data-click"));
      if (target && target !== stand) target.click();
    });
  });
})();
