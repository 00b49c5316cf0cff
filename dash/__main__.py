from dash.cli import main

raise SystemExit(main())
