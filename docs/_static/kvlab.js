/* kvlab book: small fixes to the theme's behaviour (loaded on every page by _ext/kvlab_site.py).
 *
 * The chapter list and the page contents open as modal <dialog>s on a narrow screen
 * (pydata-sphinx-theme). Picking a link in one scrolled the page behind the still-open drawer,
 * and once the pick had moved the focus out of the drawer, Esc no longer closed it: a pick
 * now closes its drawer, and Esc closes an open drawer wherever the focus is. */
(function () {
  "use strict";
  var DRAWERS = "#pst-primary-sidebar-modal, #pst-secondary-sidebar-modal";

  function closeDrawers() {
    var open = document.querySelectorAll("dialog[open]");
    for (var i = 0; i < open.length; i++) {
      if (open[i].matches(DRAWERS)) open[i].close();
    }
    return open.length > 0;
  }

  document.addEventListener("keydown", function (event) {
    if (event.key === "Escape" && closeDrawers()) event.preventDefault();
  });

  document.addEventListener("click", function (event) {
    var link = event.target.closest && event.target.closest("a[href]");
    var drawer = link && link.closest(DRAWERS);
    // after the browser has followed the link (an anchor on this page: it scrolls there)
    if (drawer && drawer.open) setTimeout(function () { drawer.close(); }, 0);
  });
})();

/* Search from a copy opened from disk (file://). Sphinx's search shows each result with a
 * summary it fetches from the result's page; a browser refuses fetch() on file:// (one console
 * error per result, and titles only). There, the search page answers those fetches from
 * _static/kvlab-search-pages.js (the pages' text, written by _ext/kvlab_site.py), loaded by a
 * <script> element, which file:// allows. */
(function () {
  "use strict";
  if (location.protocol !== "file:" || !/\/search\.html$/.test(location.pathname)) return;
  var root = document.documentElement.dataset.content_root || "./";
  var pages = new Promise(function (resolve) {
    var script = document.createElement("script");
    script.src = root + "_static/kvlab-search-pages.js";
    script.onload = function () { resolve(window.KVLAB_SEARCH_PAGES || {}); };
    script.onerror = function () { resolve({}); };
    document.head.appendChild(script);
  });
  var fetchUrl = window.fetch;
  window.fetch = function (url) {
    var name = String(url);
    if (name.indexOf(root) === 0) name = name.slice(root.length);
    if (!/\.html$/.test(name) || /^[a-z]+:/i.test(name)) return fetchUrl.apply(this, arguments);
    return pages.then(function (all) {
      return new Response(all[name.replace(/\.html$/, "")] || "",
                          {headers: {"Content-Type": "text/html"}});
    });
  };
})();

/* An inline formula wider than its paragraph's column (on a phone) is scaled down to fit it:
 * MathJax's HTML output is sized in em, so a smaller font size shrinks the whole formula. */
(function () {
  "use strict";
  function fitMath() {
    var formulas = document.querySelectorAll("span.math > mjx-container");
    for (var i = 0; i < formulas.length; i++) {
      var m = formulas[i], line = m.parentElement.parentElement;
      m.style.fontSize = "";
      var room = line ? line.clientWidth : 0, width = m.getBoundingClientRect().width;
      if (room > 0 && width > room) m.style.fontSize = Math.floor(100 * room / width) + "%";
    }
  }
  function whenTypeset(tries) {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
      MathJax.startup.promise.then(fitMath);
      window.addEventListener("resize", fitMath);
    } else if (tries > 0 && document.querySelector("span.math")) {
      setTimeout(function () { whenTypeset(tries - 1); }, 100);
    }
  }
  window.addEventListener("load", function () { whenTypeset(100); });
})();
