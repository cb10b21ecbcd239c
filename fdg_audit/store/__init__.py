"""The run folder's records: the ledger of every message (``ledger``) and the files a finished run folder holds
(``runfolder``). Training writes them; the audit and the report read them."""
