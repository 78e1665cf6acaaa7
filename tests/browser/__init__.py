"""The page in a real browser: Debian's chromium, driven by Playwright, against a real engine and
`streamlit run app/main.py` (harness.py starts and stops both)."""
