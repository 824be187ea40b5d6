"""Reports from run folders: tables and figures."""
