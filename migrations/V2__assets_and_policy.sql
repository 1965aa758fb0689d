-- Assets and deposit confirmation policy.
--
-- An asset is native ETH, native BTC, or an ERC-20 contract on ethereum registered by an
-- operator with its decimals. The asset key is text: 'ETH', 'BTC', or 'eth:0x<contract>'. It
-- comes first because deposits, postings, withdrawals and policy all reference it.
--
-- confirmation_policy makes the confirmation depth a function of value: a deposit needs the
-- confirmations of the tier with the largest min_amount not above its amount, so small deposits
-- are fast and large ones wait. Both tables are configuration and mutable.

create table asset (
    asset      text        primary key,
    chain      text        not null check (chain in ('eth', 'btc')),
    contract   text        null,
    symbol     text        not null check (length(symbol) > 0),
    decimals   smallint    not null check (decimals between 0 and 77),
    created_at timestamptz not null default now(),
    unique (chain, symbol),
    unique (chain, contract),
    -- target for composite foreign keys that also pin the asset to the row's chain
    unique (chain, asset),
    constraint asset_key_matches_kind check (
        (asset = 'ETH' and chain = 'eth' and contract is null)
        or (asset = 'BTC' and chain = 'btc' and contract is null)
        or (chain = 'eth'
            and contract is not null
            and is_valid_address('eth', contract)
            and asset = 'eth:' || contract)
    )
);

insert into asset (asset, chain, contract, symbol, decimals) values
    ('ETH', 'eth', null, 'ETH', 18),
    ('BTC', 'btc', null, 'BTC', 8);

create table confirmation_policy (
    chain         text          not null check (chain in ('eth', 'btc')),
    asset         text          not null,
    min_amount    numeric(78,0) not null check (min_amount >= 0) check (is_u256(min_amount)),
    confirmations integer       not null check (confirmations >= 0),
    primary key (chain, asset, min_amount),
    foreign key (chain, asset) references asset (chain, asset)
);

-- Shipped defaults. Amounts in wei and satoshi.
insert into confirmation_policy (chain, asset, min_amount, confirmations) values
    ('eth', 'ETH', 0,                       12),
    ('eth', 'ETH', 1000000000000000000,     32),   -- 1 ETH
    ('eth', 'ETH', 100000000000000000000,   64),   -- 100 ETH
    ('btc', 'BTC', 0,                        1),
    ('btc', 'BTC', 10000000,                 3),   -- 0.1 BTC
    ('btc', 'BTC', 100000000,                6);   -- 1 BTC
