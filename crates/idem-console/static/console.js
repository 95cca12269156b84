// idem console: live updates of the task page, and local times. The page's
// <main id="task"> names its update stream (data-live, Server-Sent Events)
// and its fragment (data-fragment, the inner HTML of #task-body); on each
// message the fragment is fetched and swapped in, one refresh at a time;
// while a person is filling in a form inside the body (the verdict's
// acknowledge form) the swap waits and #actions-stale says the page is
// behind. The stream's `end` event (the task is terminal) closes it after a
// last refresh (then data-live-done="true"). No inline script
// anywhere: this file is the console's only script (Content-Security-Policy
// script-src 'self').
// Every instant is server-rendered in UTC as <time datetime="…Z">; this
// script adds the viewer's local time after it (span.local-time, e.g.
// "13:00:03.120 UTC+01:00", with the date when it differs from the UTC
// one). That text is computed from the datetime attribute alone: the only
// data it writes is the server's RFC 3339 instant, as digits. Everything
// else comes from the fragment, HTML the server rendered, its hidden
// characters already shown as escapes (idem-console's `shown` module), so
// there is no second rule to keep in step here.
"use strict";

(function () {
  function two(n) {
    return String(n).padStart(2, "0");
  }

  // "UTC+01:00", "UTC-05:30", "UTC+00:00": a date's offset.
  function offsetWords(d) {
    var minutes = -d.getTimezoneOffset();
    if (minutes === 0) {
      return "UTC+00:00";
    }
    var sign = minutes > 0 ? "+" : "-";
    var abs = Math.abs(minutes);
    return "UTC" + sign + two(Math.floor(abs / 60)) + ":" + two(abs % 60);
  }

  // The local time of every <time datetime> under `root` not yet given one.
  function localTimes(root) {
    var times = root.querySelectorAll("time[datetime]");
    for (var i = 0; i < times.length; i++) {
      var el = times[i];
      if (el.dataset.local) {
        continue;
      }
      var iso = el.getAttribute("datetime");
      var d = new Date(iso);
      if (isNaN(d.getTime())) {
        continue;
      }
      var date = d.getFullYear() + "-" + two(d.getMonth() + 1) + "-" + two(d.getDate());
      var clock = two(d.getHours()) + ":" + two(d.getMinutes()) + ":" + two(d.getSeconds()) +
        "." + String(d.getMilliseconds()).padStart(3, "0");
      var text = (date === iso.slice(0, 10) ? "" : date + " ") + clock + " " + offsetWords(d);
      var span = document.createElement("span");
      span.className = "local-time";
      span.title = "your local time";
      span.textContent = text;
      el.dataset.local = text;
      el.after(" (", span, ")");
    }
  }

  // Whether a person has started filling in a form inside the task's body
  // (the verdict's acknowledge forms): a swap would throw that away.
  function editing(body) {
    var fields = body.querySelectorAll("form textarea, form input");
    for (var i = 0; i < fields.length; i++) {
      var f = fields[i];
      if (f.type === "hidden") {
        continue;
      }
      if ((f.type === "radio" || f.type === "checkbox") ? f.checked : f.value !== "") {
        return true;
      }
    }
    return false;
  }

  function refresh(main, body) {
    if (editing(body)) {
      // Keep what is being typed; say that the page is behind.
      var notice = document.getElementById("actions-stale");
      if (notice) {
        notice.hidden = false;
      }
      return Promise.resolve();
    }
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
          localTimes(body);
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
    localTimes(document);
    var main = document.getElementById("task");
    var body = document.getElementById("task-body");
    if (!main || !body || !main.dataset.live || !window.EventSource) {
      return;
    }
    var source = new EventSource(main.dataset.live);
    var last = null;
    // One refresh at a time, in the order asked: a slow fragment never
    // lands after a newer one.
    var queue = Promise.resolve();
    function schedule() {
      queue = queue.then(function () {
        return refresh(main, body);
      });
      return queue;
    }
    source.addEventListener("change", function (e) {
      if (e.data !== last) {
        last = e.data;
        schedule();
      }
    });
    source.addEventListener("end", function () {
      source.close();
      main.dataset.liveEnded = "true";
      // data-live-done: the last refresh is in (tests wait for it).
      schedule().then(function () {
        main.dataset.liveDone = "true";
      });
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
