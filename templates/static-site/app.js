// Runs in the browser; relative URLs keep the preview under /preview/<instance_id>/.
document.getElementById("message").textContent = "Hello from a static site";
