// idem console: live updates of the task page. The page's <main id="task">
// names its update stream (data-live, Server-Sent Events) and its fragment
// (data-fragment, the inner HTML of #task-body); on each message the
// fragment is fetched and swapped in. The stream's `end` event (the task is
// terminal) closes it after a last refresh. No inline script anywhere: this
// file is the console's only script (Content-Security-Policy script-src 'self').
// It writes no text of its own into the page: the fragment is HTML the server
// rendered, its hidden characters already shown as escapes (idem-console's
// `shown` module), so there is no second rule to keep in step here.
"use strict";

(function () {
  function refresh(main, body) {
    return fetch(main.dataset.fragment, {
      credentials: "same-origin",
      headers: { Accept: "text/html" },
    })
      .then(function (res) {
        if (!res.ok) {
          return null;
        }
        return res.text();
      })
      .then(function (html) {
        if (html !== null && html !== undefined) {
          body.innerHTML = html;
          main.dataset.refreshed = String(Date.now());
          flagStaleActions();
        }
      })
      .catch(function () {});
  }

  // The action forms are drawn for the state the page loaded with: say so
  // when the live state has moved on.
  function flagStaleActions() {
    var actions = document.getElementById("actions");
    var state = document.getElementById("task-state");
    var notice = document.getElementById("actions-stale");
    if (actions && state && notice) {
      notice.hidden = actions.dataset.state === state.dataset.state;
    }
  }

  function start() {
    var main = document.getElementById("task");
    var body = document.getElementById("task-body");
    if (!main || !body || !main.dataset.live || !window.EventSource) {
      return;
    }
    var source = new EventSource(main.dataset.live);
    var last = null;
    source.addEventListener("change", function (e) {
      if (e.data !== last) {
        last = e.data;
        refresh(main, body);
      }
    });
    source.addEventListener("end", function () {
      source.close();
      main.dataset.liveEnded = "true";
      refresh(main, body);
    });
    source.onerror = function () {
      // The browser reconnects by itself; a 401 or 404 closes the stream.
      if (source.readyState === EventSource.CLOSED) {
        main.dataset.liveEnded = "true";
      }
    };
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
