"""App-sandbox features of the bound session: background processes and their init,
logs, runtime errors, trace scanning, static analysis."""
