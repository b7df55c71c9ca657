module example.com/patterns/enterprise/outbox/lessoncheck

go 1.26.0

require example.com/patterns/enterprise/outbox v0.0.0

replace example.com/patterns/enterprise/outbox => ../
