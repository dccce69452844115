// The key form of /dashboard: POSTs the key as JSON (never in a URL); the answer sets the dashboard's cookie.
"use strict";
document.getElementById("login").addEventListener("submit", async (e) => {
  e.preventDefault();
  const error = document.getElementById("error");
  error.textContent = "";
  try {
    const r = await fetch("dashboard/login", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ api_key: document.getElementById("api-key").value }),
      credentials: "same-origin",
    });
    if (r.status === 204) {
      window.location.reload();
      return;
    }
    error.textContent = r.status === 401 ? "That is not the server's API key." : "The server answered " + r.status + ".";
  } catch (err) {
    error.textContent = "The server cannot be reached.";
  }
});
