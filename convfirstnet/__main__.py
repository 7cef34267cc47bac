from convfirstnet.commands.cli import main

raise SystemExit(main())
