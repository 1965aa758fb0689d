-- BTC hot wallets (DESIGN §7b): a lane's hot_wallet row holds its funding address (…/0/0 of a
-- BIP-84 account); the account's extended public key is kept here, to derive change addresses
-- (…/1/i, allocated in order like deposit addresses). The private key stays in its file.
create table btc_hot_wallet (
    chain             text        not null default 'btc' check (chain = 'btc'),
    lane              text        not null,
    address           text        not null,
    account_xpub      text        not null unique check (length(account_xpub) between 100 and 120),
    next_change_index integer     not null default 0 check (next_change_index >= 0),
    created_at        timestamptz not null default now(),
    primary key (chain, lane),
    foreign key (chain, address) references hot_wallet (chain, address)
);

grant select, insert on btc_hot_wallet to custodian_service;
grant update (next_change_index) on btc_hot_wallet to custodian_service;
